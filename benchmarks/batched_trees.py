"""Batched trees (issue 57): SpecExec over a batch of prompts against the same prompts one after another, and against
plain batched ``generate()``, in one run.

A target streamed from disk costs about as much per forward for one token as for tens (the default target on the
2-core development CPU is flat to about 64 tokens), and one SpecExec tree uses part of that. With ``generate()``
taking a batch, one forward verifies every row's tree. Per chunk of ``--batch`` prompts, taking turns so that drift
falls on every method alike:

- ``plain batched``: ``target.generate(ids, attention_mask=...)`` over the left-padded chunk;
- ``specexec batched``: the same call with ``assistant_model=draft, speculator="specexec"``;
- ``specexec one by one``: each prompt of the chunk alone through SpecExec.

Greedy, float32 (outputs must be identical: each row's new tokens are compared across the three; a difference fails
the run). Aggregate tokens/s is every prompt's new tokens over the method's total seconds; each figure goes through
``figure_checks`` before it is written. The issue's CPU goal: batch 4, 8 held-out prompts, the default pair with the
target streamed from disk under a RAM cap below its weights (this process in a cgroup v1 memory group, page cache
included, as ``ssd.py`` caps it; root needed): batched >= 2x one by one and >= 1.7x plain batched.

Not a test: the figures depend on the disk, the CPU and the load.
Run (root):  .venv/bin/python -m benchmarks.batched_trees
Smoke run (tiny random models in memory, no cap, no root; timings meaningless):
             .venv/bin/python -m benchmarks.batched_trees --tiny --no-cap
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

import specexec_hf
from specexec_hf import SpecExecStats

from benchmarks.figure_checks import positive
from benchmarks.memory_cap import MemoryCap, evict
from benchmarks.report import Goal, table, write_report
from benchmarks.ssd import capped, cpu_description

RESULTS = Path(__file__).resolve().parent / "results" / "batched_trees"
GROUP = "specexec_batched_trees"


def tiny_pair() -> tuple[torch.nn.Module, torch.nn.Module, None]:
    """A tiny random target and a slightly perturbed copy as its draft (smoke runs), in float64: their near-uniform
    logits would otherwise tie within float32 rounding, where padding alone changes plain batched greedy output."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).double().eval()
    draft = LlamaForCausalLM(config).double().eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(0.02 * torch.randn_like(parameter))
    return target, draft, None


def default_pair_streamed(cap: MemoryCap | None, weights_memory: float):
    """The default draft in RAM and the default target streamed from disk, in float32. With a ``cap``, the target
    loads under the runtime and the draft plus ``weights_memory`` of its weights' size, so that ``prefetch="auto"``
    sizes its ring within that room (as ``ssd.py``'s end to end does); the timed runs are capped again after the
    warm-ups (:func:`capped_for_timing`)."""
    from specexec_hf.models.default_pair import default_target_dir
    from specexec_hf.offload import load_offloaded

    _, draft, tokenizer = specexec_hf.load_default_pair(dtype=torch.float32, draft_dtype=torch.float32)
    checkpoint = default_target_dir()
    loading = capped(cap, weights_bytes(checkpoint), weights_memory)
    target = load_offloaded(checkpoint, max_memory={"cpu": 0}, executor="stream", dtype=torch.float32)
    return target, draft, tokenizer, loading


def weights_bytes(checkpoint: Path) -> int:
    return sum(path.stat().st_size for path in checkpoint.glob("*.safetensors"))


def capped_for_timing(cap: MemoryCap | None, target, weights_memory: float) -> dict:
    """After the warm-ups (run with the cap lifted): the weight files evicted from the page cache and the process
    capped at what it holds now (runtime, draft, ring, what the warm-ups left) plus what the ring leaves of
    ``weights_memory`` of the weights: the ring, the activations, the caches and the page cache share less room than
    the weights take, so every forward reads them from the disk."""
    from specexec_hf.models.default_pair import default_target_dir
    from specexec_hf.offload import layer_streamer

    checkpoint = default_target_dir()
    for path in checkpoint.glob("*.safetensors"):
        evict(path)
    ring = layer_streamer(target).buffer_bytes
    return capped(cap, weights_bytes(checkpoint), weights_memory, ring) | {"ring_bytes": ring}


def prompts_of(tokenizer, count: int, tiny: bool) -> list[list[int]]:
    """``count`` held-out prompts as chat token ids (random ids for the tiny pair)."""
    if tiny:
        generator = torch.Generator().manual_seed(1)
        return [torch.randint(1, 64, (int(length),), generator=generator).tolist()
                for length in torch.randint(3, 12, (count,), generator=generator)]
    from specexec_hf.tools.prompts import encode_chats, load_prompts

    return encode_chats(tokenizer, load_prompts("eval")[:count])


def left_padded(prompts: list[list[int]], pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(prompt) for prompt in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def new_tokens(row: torch.Tensor, eos: set[int]) -> list[int]:
    """A row's generated tokens up to and including its first EOS (the padding after it dropped)."""
    tokens = row.tolist()
    for index, token in enumerate(tokens):
        if token in eos:
            return tokens[: index + 1]
    return tokens


def timed(generate, *args, **kwargs):
    """``generate(*args, **kwargs)`` and the seconds it took."""
    started = time.perf_counter()
    result = generate(*args, **kwargs)
    return result, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--budget", type=lambda text: text if text == "auto" else int(text), default=16,
                        help='tree nodes per row, or "auto" (per step: one prompt\'s measured choice; a batch\'s '
                             'step total from the forward profile)')
    parser.add_argument("--weights-memory", type=float, default=0.8,
                        help="the memory the target gets in all (ring, activations, caches, page cache) under the cap, "
                             "as a share of its weights' size (below 1: the weights cannot all stay in RAM)")
    parser.add_argument("--no-cap", action="store_true", help="run without the cgroup cap (no root needed)")
    parser.add_argument("--tiny", action="store_true", help="tiny random models in memory: a smoke run")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()

    cap = None if args.no_cap else MemoryCap(GROUP)
    if cap is not None:
        reason = MemoryCap.unavailable()
        if reason:
            raise SystemExit(f"The RAM cap needs root and a cgroup v1 memory controller ({reason}); pass --no-cap "
                             "to run uncapped.")
        cap.join()  # first: pages charged before joining would stay outside the group
    load_before = os.getloadavg()
    if args.tiny:
        target, draft, tokenizer = tiny_pair()
        pad = 0
    else:
        target, draft, tokenizer, loading = default_pair_streamed(cap, args.weights_memory)
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos_ids = target.generation_config.eos_token_id
    eos = set(eos_ids if isinstance(eos_ids, list) else [] if eos_ids is None else [eos_ids])
    prompts = prompts_of(tokenizer, args.prompts, args.tiny)
    common = {"max_new_tokens": args.max_new_tokens, "do_sample": False, "pad_token_id": pad}
    specexec = {"assistant_model": draft, "speculator": "specexec", "budget": args.budget}

    # One short untimed call of each kind first: the first call of a process pays its one-time costs (threads, the
    # page cache's first read of the target, the draft's calibration), which would fall on whichever method ran first.
    if cap is not None and not args.tiny:
        cap.limit(None)  # the warm-ups uncapped, the ring sized under the cap already
    warm_ids, warm_mask = left_padded(prompts[: args.batch], pad)
    warm = {**common, "max_new_tokens": 2}
    target.generate(warm_ids, attention_mask=warm_mask, **warm)
    target.generate(warm_ids, attention_mask=warm_mask, **warm, **specexec)
    target.generate(torch.tensor([prompts[0]]), **warm, **specexec)
    timing_cap = capped_for_timing(cap, target, args.weights_memory) if not args.tiny else {"capped": False}

    seconds = {"plain batched": 0.0, "specexec batched": 0.0, "specexec one by one": 0.0}
    forwards = {"specexec batched": 0, "specexec one by one": 0}
    generated, mismatches = 0, []
    for start in range(0, len(prompts), args.batch):
        chunk = prompts[start : start + args.batch]
        ids, mask = left_padded(chunk, pad)
        width = ids.shape[1]
        plain, spent = timed(target.generate, ids, attention_mask=mask, **common)
        seconds["plain batched"] += spent
        stats = SpecExecStats()
        batched, spent = timed(target.generate, ids, attention_mask=mask, **common, **specexec, specexec_stats=stats)
        seconds["specexec batched"] += spent
        forwards["specexec batched"] += stats.target_forwards
        for row, prompt in enumerate(chunk):
            alone_stats = SpecExecStats()
            alone, spent = timed(target.generate, torch.tensor([prompt]), **common, **specexec,
                                 specexec_stats=alone_stats)
            seconds["specexec one by one"] += spent
            forwards["specexec one by one"] += alone_stats.target_forwards
            expected = new_tokens(alone[0, len(prompt) :], eos)
            generated += len(expected)
            for method, output in (("plain batched", plain), ("specexec batched", batched)):
                if new_tokens(output[row, width:], eos) != expected:
                    mismatches.append({"prompt": start + row, "method": method})

    tokens_per_second = {method: positive(f"{method} tokens/s", generated / positive(f"{method} seconds", spent))
                         for method, spent in seconds.items()}
    batched = tokens_per_second["specexec batched"]
    ratios = {
        "batched / one by one": positive("batched / one by one", batched / tokens_per_second["specexec one by one"]),
        "batched / plain batched": positive("batched / plain batched", batched / tokens_per_second["plain batched"]),
    }
    goals = [
        Goal("batched_vs_one_by_one", f"SpecExec batch {args.batch} / SpecExec one prompt after another (tokens/s)",
             ratios["batched / one by one"], 2.0),
        Goal("batched_vs_plain_batched", f"SpecExec batch {args.batch} / plain batched generate() (tokens/s)",
             ratios["batched / plain batched"], 1.7),
    ]
    result = {
        "command": " ".join([sys.executable, "-m", "benchmarks.batched_trees", *sys.argv[1:]]),
        "machine": f"{cpu_description()}, {os.cpu_count()} cores",
        "load_average_before": load_before,
        "memory_cap": None if cap is None or args.tiny else {
            "while_loading": loading, "timed_runs": timing_cap, "peak_bytes": cap.peak(), "cap_hits": cap.failures(),
        },
        "setting": {key: value for key, value in vars(args).items() if key != "out"} | {"out": str(args.out)},
        "new_tokens": generated,
        "seconds": seconds,
        "tokens_per_second": tokens_per_second,
        "target_forwards": forwards,
        "ratios": ratios,
        "goals": goals,
        "outputs_identical": not mismatches,
        "mismatches": mismatches,
    }
    rows = [(method, f"{tokens_per_second[method]:.2f}", f"{seconds[method]:.2f}", forwards.get(method))
            for method in seconds]
    capping = ("no RAM cap" if cap is None or args.tiny else
               f"RAM cap: the target gets {args.weights_memory} of its weights' size in all (cgroup v1)")
    lines = [f"# batched_trees\n\n`{result['command']}`\n\n{result['machine']}; load average before "
             f"{load_before[0]:.2f}; {capping}\n",
             *table(("method", "tokens/s", "seconds", "target forwards"), rows, (False, True, True, True)),
             "", *(goal.line() for goal in goals), f"- outputs identical: {not mismatches}"]
    write_report(args.out, "batched_trees", result, "\n".join(lines))
    print("\n".join(lines))
    if cap is not None:
        cap.leave()
    if mismatches:
        raise SystemExit(f"outputs differ: {mismatches}")


if __name__ == "__main__":
    main()
