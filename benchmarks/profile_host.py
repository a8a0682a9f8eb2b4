"""Where a SpecExec step's host time goes: everything but the target's and the draft's forwards.

Runs SpecExec on a few eval prompts, times both models' forwards with hooks and splits the rest of each step
into phases; then runs the same generations under cProfile and lists the functions with the most own time.

Run: .venv/bin/python benchmarks/profile_host.py [--budget 256] [--prompts 2] [--max-new-tokens 32]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

import specexec_hf
from specexec_hf.tools.bench import ForwardMeter, pick_prompts, truncated_draft
from specexec_hf.tools.prompts import chat_inputs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--draft", default="default", help="'default' or 'truncated:N'")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=25, help="Functions to list.")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.draft == "default":
        target, draft, tokenizer = specexec_hf.load_default_pair()
    else:
        target, tokenizer = specexec_hf.load_default_target()
        draft = truncated_draft(target, int(args.draft.removeprefix("truncated:")))
    prompts = [chat_inputs(tokenizer, prompt) for prompt in pick_prompts(args.prompts)]
    kwargs = dict(do_sample=False, assistant_model=draft, speculator="specexec", budget=args.budget)
    target.generate(**prompts[0], max_new_tokens=4, **kwargs)  # warm-up

    # First without the profiler: hooks time the forwards, SpecExecStats the draft and target phases of each
    # step, so host time splits into tree growth, target-side preparation and the rest of the loop.
    stats = specexec_hf.SpecExecStats()
    with ForwardMeter(target) as target_meter, ForwardMeter(draft) as draft_meter:
        started = time.perf_counter()
        for inputs in prompts:
            target.generate(**inputs, max_new_tokens=args.max_new_tokens, specexec_stats=stats, **kwargs)
        wall = time.perf_counter() - started
    steps = stats.target_forwards
    phases = {
        "target forwards": target_meter.seconds,
        "draft forwards": draft_meter.seconds,
        "host: tree growth (search, draft masks, log-softmax/top-k)": stats.draft_seconds - draft_meter.seconds,
        "host: target masks and cache around the forward": stats.target_seconds - target_meter.seconds,
        "host: acceptance walk, cache compaction, rest of the loop": wall - stats.draft_seconds - stats.target_seconds,
    }
    print(f"budget {args.budget}: {steps} steps, {stats.new_tokens} tokens, {wall:.2f} s, "
          f"{wall / steps * 1e3:.0f} ms/step, {draft_meter.calls / steps:.1f} draft forwards/step")
    for name, seconds in phases.items():
        print(f"  {name:<62} {seconds / steps * 1e3:8.1f} ms/step {seconds / wall:7.1%}")
    host = sum(seconds for name, seconds in phases.items() if name.startswith("host"))
    print(f"  {'host total':<62} {host / steps * 1e3:8.1f} ms/step {host / wall:7.1%}")

    profiler = cProfile.Profile()
    profiler.enable()
    for inputs in prompts:
        target.generate(**inputs, max_new_tokens=args.max_new_tokens, **kwargs)
    profiler.disable()
    buffer = io.StringIO()
    pstats.Stats(profiler, stream=buffer).sort_stats("tottime").print_stats(args.top)
    print(buffer.getvalue())
    buffer = io.StringIO()
    pstats.Stats(profiler, stream=buffer).sort_stats("cumulative").print_stats("specexec_hf", args.top)
    print(buffer.getvalue())


if __name__ == "__main__":
    main()
