"""``specexec-hf``: generate with SpecExec from the command line, distill drafts, and benchmark."""

from __future__ import annotations

import argparse
import sys
import time

from ..core.config import SpecExecConfig


def _add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    from .bench import add_model_arguments

    defaults = SpecExecConfig()
    parser.add_argument("--prompt", required=True, help="User message; it is wrapped in the target's chat template.")
    add_model_arguments(parser)
    parser.add_argument("--max-new-tokens", type=int, default=128, help="Tokens to generate at most (default 128).")
    parser.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="0 decodes greedily (output identical to the target's own greedy output); > 0 samples exactly from "
        "the target's distribution at that temperature (default 0).",
    )
    parser.add_argument("--top-p", type=float, default=None, help="Nucleus sampling threshold when sampling.")
    parser.add_argument(
        "--budget",
        type=int,
        default=defaults.budget,
        help=f"Draft tokens per tree, i.e. tokens the target scores per forward (default {defaults.budget}). "
        "Small for an in-memory target on a CPU, hundreds for an offloaded one.",
    )
    parser.add_argument(
        "--max-depth", type=int, default=defaults.max_depth, help=f"Deepest tree level (default {defaults.max_depth})."
    )
    parser.add_argument(
        "--max-branch",
        type=int,
        default=defaults.max_branch,
        help=f"Children considered per expanded node (default {defaults.max_branch}).",
    )
    parser.add_argument(
        "--no-specexec", action="store_true", help="Plain generate() with the target alone, for comparison."
    )
    parser.add_argument("--seed", type=int, default=0, help="Random seed for sampling (default 0).")


def _run_generate(args: argparse.Namespace) -> int:
    import torch
    from transformers import TextStreamer

    from ..core import SpecExecStats
    from .bench import execution_device, load_models
    from .prompts import chat_inputs

    target, draft, tokenizer, _ = load_models(args, with_draft=not args.no_specexec)
    inputs = chat_inputs(tokenizer, args.prompt).to(execution_device(target))
    sampling = args.temperature > 0
    kwargs = dict(
        max_new_tokens=args.max_new_tokens,
        do_sample=sampling,
        temperature=args.temperature if sampling else None,
        top_p=args.top_p if sampling else None,
        streamer=TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True),
    )
    stats = SpecExecStats()
    if not args.no_specexec:
        kwargs.update(
            assistant_model=draft,
            speculator="specexec",
            budget=args.budget,
            max_depth=args.max_depth,
            max_branch=args.max_branch,
            specexec_stats=stats,
        )
    torch.manual_seed(args.seed)
    started = time.perf_counter()
    output = target.generate(**inputs, **kwargs)
    seconds = time.perf_counter() - started
    new_tokens = output.shape[1] - inputs["input_ids"].shape[1]
    report = f"\n[{new_tokens} tokens in {seconds:.1f} s, {new_tokens / seconds:.1f} tok/s"
    if not args.no_specexec:
        report += f", {stats.tokens_per_target_forward:.2f} tokens per target forward"
    print(report + "]", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from . import bench, calibrate, distill

    parser = argparse.ArgumentParser(prog="specexec-hf", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    generate = commands.add_parser(
        "generate", help="Generate a chat answer with SpecExec, streaming it.", description="Generate with SpecExec."
    )
    _add_generate_arguments(generate)
    generate.set_defaults(handler=_run_generate)
    for name, module, summary in (
        ("distill", distill, "Distill a small draft for a target that lacks a small sibling."),
        ("bench", bench, "Benchmark SpecExec against autoregressive, HF assisted, SpecInfer- and Sequoia-style trees."),
        ("calibrate", calibrate, "Fit a draft's greedy tree-ranking temperature on its target's greedy answers."),
    ):
        subparser = commands.add_parser(
            name, help=summary, description=module.__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
        )
        module.add_arguments(subparser)
        subparser.set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    sys.exit(main())
