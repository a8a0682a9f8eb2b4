"""``specexec-hf``: generate with SpecExec from the command line, distill drafts, and benchmark."""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path
from typing import Any, Literal, NoReturn

from ..core.config import SpecExecConfig

PROG = "specexec-hf"
# The subcommands that load a target and a draft (bench.add_model_arguments), whose options are checked first.
MODEL_COMMANDS = ("generate", "bench")


class Parser(argparse.ArgumentParser):
    """argparse's parser, but a mistake ends in one line on stderr (exit code 2) that points to ``--help``, without
    argparse's usage lines before it (a subcommand's usage runs to a dozen lines)."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def positive_int(text: str, expected: str = "a whole number of at least 1") -> int:
    """An option's whole number of at least 1, as argparse's ``type=`` takes it."""
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
    return int(text)


def positive_int_or_auto(text: str) -> int | Literal["auto"]:
    """A whole number of at least 1, or ``auto`` (``--budget``: chosen before every step)."""
    return text if text == "auto" else positive_int(text, "'auto' or a whole number of at least 1")


def non_negative_float(text: str) -> float:
    """A finite number of at least 0 (``--temperature``)."""
    value = _float(text)
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a number of at least 0, got {text!r}")
    return value


def probability(text: str) -> float:
    """A number in (0, 1] (``--top-p``)."""
    value = _float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"expected a number above 0 and at most 1, got {text!r}")
    return value


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def _add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    from .bench import add_model_arguments

    defaults = SpecExecConfig()
    parser.add_argument("--prompt", required=True, help="User message; it is wrapped in the target's chat template.")
    add_model_arguments(parser)
    parser.add_argument(
        "--max-new-tokens", type=positive_int, default=128, help="Tokens to generate at most (default 128)."
    )
    parser.add_argument(
        "--temperature",
        type=non_negative_float,
        default=0.0,
        help="0 decodes greedily (output identical to the target's own greedy output); > 0 samples exactly from "
        "the target's distribution at that temperature (default 0).",
    )
    parser.add_argument("--top-p", type=probability, default=None, help="Nucleus sampling threshold when sampling.")
    parser.add_argument(
        "--budget",
        type=positive_int_or_auto,
        default=defaults.budget,
        help=f"Draft tokens per tree, i.e. tokens the target scores per forward (default {defaults.budget}). "
        "Small for an in-memory target on a CPU, hundreds for an offloaded one; 'auto' picks it before every step "
        "from the measured forward times and acceptance.",
    )
    parser.add_argument(
        "--max-depth",
        type=positive_int,
        default=defaults.max_depth,
        help=f"Deepest tree level (default {defaults.max_depth}).",
    )
    parser.add_argument(
        "--max-branch",
        type=positive_int,
        default=defaults.max_branch,
        help=f"Children considered per expanded node (default {defaults.max_branch}).",
    )
    parser.add_argument(
        "--no-specexec", action="store_true", help="Plain generate() with the target alone, for comparison."
    )
    parser.add_argument("--seed", type=int, default=0, help="Random seed for sampling (default 0).")


# What identifies the default target, beside its tokenizer: a saved copy of it matches on all of them, in any dtype.
DEFAULT_TARGET_FIELDS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rope_parameters", "rms_norm_eps", "tie_word_embeddings",
)


def check_model_options(args: argparse.Namespace) -> None:
    """Refuses, before any model is loaded, a ``--target`` or ``--draft`` that cannot work, reading only configs and
    tokenizers: a model that cannot be read, a draft export that is not there, a draft whose tokenizer is not the
    target's, ``truncated:N`` or a layer self-draft naming layers the target lacks, ``--draft default`` for another
    target than the default one. For a copy of the default target, ``--draft default`` is pointed at the shipped
    draft's file, which :func:`~.bench.load_models` builds from any target.

    Raises:
        SystemExit: The mistake, with what to give instead.
    """
    from .. import models
    from ..hf.compat import check_same_tokenizer

    target = _config_and_tokenizer(args.target, "--target") if args.target is not None else None
    name = None if getattr(args, "no_specexec", False) else args.draft
    if name is None or name == "target" or name in models.SELF_DRAFTS:
        return  # no draft, the default pair, or a draft made from any target
    if name == "default":
        if target is not None:
            _point_at_shipped_draft(args, *target)
        return
    if name.endswith(".safetensors"):
        try:
            models.draft_export_path(name)
        except FileNotFoundError as error:
            raise SystemExit(str(error)) from None
        return
    config, tokenizer = target or _config_and_tokenizer(str(models.default_target_dir()), "--target")
    if name.startswith("truncated:"):
        layers, available = name.removeprefix("truncated:"), config.num_hidden_layers
        if layers.isdigit() and int(layers) > available:  # load_models refuses the ones that are not a count
            raise SystemExit(f"--draft {name}: the target has {available} layers; take at most truncated:{available}.")
    elif any(name == kind or name.startswith(kind + ":") for kind in models.LAYER_SELF_DRAFTS):
        _check_layer_self_draft(name, config)
    else:
        _config(name, "--draft")
        try:  # as generate() compares them; a draft saved without a tokenizer is taken to share the target's
            check_same_tokenizer(tokenizer, _tokenizer(name))
        except ValueError as error:
            raise SystemExit(f"--draft {name}: {error}") from None


def _config(path: str, option: str) -> Any:
    """The config of the model ``option`` names, or a refusal naming the option."""
    from transformers import AutoConfig

    from .bench import DRAFT_KINDS_HELP

    try:
        return AutoConfig.from_pretrained(path)
    except (OSError, ValueError):
        where = "a directory without a model's config.json" if Path(path).is_dir() else (
            "no such directory, nor a model of that name on the Hugging Face Hub"
        )
        kinds = f"; --draft takes {DRAFT_KINDS_HELP}" if option == "--draft" else ""
        raise SystemExit(f"{option} {path}: {where}{kinds}.") from None


def _tokenizer(path: str) -> Any:
    """The tokenizer saved at ``path``; ``None`` where there is none."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError):
        return None


def _config_and_tokenizer(path: str, option: str) -> tuple[Any, Any]:
    """The config and tokenizer of the model ``option`` names (the command reads the target's tokenizer beside it),
    or a refusal naming the option."""
    config, tokenizer = _config(path, option), _tokenizer(path)
    if tokenizer is None:
        raise SystemExit(f"{option} {path}: no tokenizer there; save the model's tokenizer beside it "
                         "(tokenizer.save_pretrained(directory)).")  # fmt: skip
    return config, tokenizer


def _check_layer_self_draft(name: str, target_config: Any) -> None:
    """Refuses ``self:exit:K`` / ``self:skip:<layers>`` names the target's layers do not fit, by the library's own
    check on the target built without weights."""
    import torch
    from transformers import AutoModelForCausalLM

    from ..models.self_draft import layer_spec

    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(target_config)
    try:
        layer_spec(skeleton, name)
    except ValueError as error:
        raise SystemExit(f"--draft {error}") from None


def _point_at_shipped_draft(args: argparse.Namespace, target_config: Any, target_tokenizer: Any) -> None:
    """``--draft default`` with ``--target``: the shipped draft's file when the target is the default one (its
    config and tokenizer), else a refusal."""
    from .. import models
    from .bench import DEFAULT_TARGET_NAME

    default_config, default_tokenizer = _config_and_tokenizer(str(models.default_target_dir()), "the default target")
    same_config = all(
        getattr(target_config, field, None) == getattr(default_config, field, None) for field in DEFAULT_TARGET_FIELDS
    )
    if not same_config or target_tokenizer.get_vocab() != default_tokenizer.get_vocab():
        raise SystemExit(
            f"--draft default is the draft distilled for {DEFAULT_TARGET_NAME}, and --target {args.target} is another "
            "model (its config or tokenizer differs): give a draft for it, such as its small sibling's directory, "
            "'self:int4' or 'target'."
        )
    args.draft = str(models.draft_export_path("default"))


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

    parser = Parser(prog=PROG, description=__doc__)
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
    """Runs a ``specexec-hf`` command; a refusal (a ``SystemExit`` with its reason, from the checks before any model
    is loaded or from the command itself) ends in one line on stderr with exit code 2, as argparse's errors do."""
    args = build_parser().parse_args(argv)
    try:
        if args.command in MODEL_COMMANDS:
            check_model_options(args)
        return args.handler(args)
    except SystemExit as refusal:
        if not isinstance(refusal.code, str):
            raise
        Parser(prog=f"{PROG} {args.command}").error(refusal.code)


if __name__ == "__main__":
    sys.exit(main())
