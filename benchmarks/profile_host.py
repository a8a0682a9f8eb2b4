"""Where a SpecExec step's host time goes: everything but the target's and the draft's forwards.

Runs SpecExec on a few eval prompts, times both models' forwards with hooks and splits the rest of each step
into phases; then runs the same generations under cProfile and lists the functions with the most own time.

On a GPU (``--device cuda``, the default when CUDA is available) both models run there. CUDA kernels run
asynchronously, so the forward hooks wait for the GPU at each forward's start and end: the forward times are then
device times, and the host phases are what the host adds when it cannot run ahead (an upper bound of what overlap
would leave). ``--sync-sites`` also runs one pass under ``torch.cuda.set_sync_debug_mode("warn")`` and counts the
host-device synchronisations per step by the Python line that caused them: the host round trips of the hot loop.

Run: .venv/bin/python -m benchmarks.profile_host [--budget 256] [--prompts 2] [--max-new-tokens 32] [--device cuda]
     [--sync-sites]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
import warnings
from collections import Counter

import torch

import specexec_hf
from specexec_hf.tools.bench import ForwardMeter, pick_prompts, truncated_draft
from specexec_hf.tools.prompts import chat_inputs


class SynchronizedForwardMeter(ForwardMeter):
    """A :class:`ForwardMeter` that waits for the GPU when an outermost forward starts and ends."""

    def _before(self, module, args) -> None:
        if self._depth == 0:
            torch.cuda.synchronize()
        super()._before(module, args)

    def _after(self, module, args, output) -> None:
        if self._depth == 1:
            torch.cuda.synchronize()
        super()._after(module, args, output)


def sync_sites(target, prompts: list, kwargs: dict, max_new_tokens: int, top: int) -> None:
    """Prints the Python lines that made the host wait for the GPU, with their count per SpecExec step.

    Args:
        target: The target model, on the GPU.
        prompts: Tokenized prompts, on the GPU.
        kwargs: generate() arguments of the SpecExec run.
        max_new_tokens: Tokens per prompt.
        top: Lines to list.
    """
    stats = specexec_hf.SpecExecStats()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for inputs in prompts:
                target.generate(**inputs, max_new_tokens=max_new_tokens, specexec_stats=stats, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    sites = Counter(
        (warning.filename, warning.lineno) for warning in caught if "synchroniz" in str(warning.message).lower()
    )
    steps = stats.target_forwards
    total = sum(sites.values())
    ours = sum(count for (filename, _), count in sites.items() if "specexec_hf" in filename)
    print(f"\nhost-device synchronisations: {total / steps:.1f} per step ({ours / steps:.1f} in specexec_hf), "
          f"{stats.draft_forwards / steps:.1f} draft forwards per step")
    for (filename, line), count in sites.most_common(top):
        print(f"  {count / steps:8.1f} per step  {filename}:{line}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--budget", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--draft", default="default", help="'default' or 'truncated:N'")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--top", type=int, default=25, help="Functions (and synchronising lines) to list.")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--sync-sites", action="store_true", help="count host-device synchronisations by line (cuda)")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    if args.sync_sites and args.device != "cuda":
        parser.error("--sync-sites counts host-device synchronisations: it needs --device cuda")
    torch.set_num_threads(args.threads)
    if args.draft == "default":
        target, draft, tokenizer = specexec_hf.load_default_pair()
    else:
        target, tokenizer = specexec_hf.load_default_target()
        draft = truncated_draft(target, int(args.draft.removeprefix("truncated:")))
    target.to(args.device)
    draft.to(args.device)
    prompts = [chat_inputs(tokenizer, prompt).to(args.device) for prompt in pick_prompts(args.prompts)]
    kwargs = dict(do_sample=False, assistant_model=draft, speculator="specexec", budget=args.budget)
    target.generate(**prompts[0], max_new_tokens=4, **kwargs)  # warm-up

    # First without the profiler: hooks time the forwards, SpecExecStats the draft and target phases of each
    # step, so host time splits into tree growth, target-side preparation and the rest of the loop.
    meter = SynchronizedForwardMeter if args.device == "cuda" else ForwardMeter
    stats = specexec_hf.SpecExecStats()
    with meter(target) as target_meter, meter(draft) as draft_meter:
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
    print(f"{args.device}, budget {args.budget}: {steps} steps, {stats.new_tokens} tokens, {wall:.2f} s, "
          f"{wall / steps * 1e3:.0f} ms/step, {draft_meter.calls / steps:.1f} draft forwards/step")
    for name, seconds in phases.items():
        print(f"  {name:<62} {seconds / steps * 1e3:8.1f} ms/step {seconds / wall:7.1%}")
    host = sum(seconds for name, seconds in phases.items() if name.startswith("host"))
    print(f"  {'host total':<62} {host / steps * 1e3:8.1f} ms/step {host / wall:7.1%}")
    if args.sync_sites:
        sync_sites(target, prompts, kwargs, args.max_new_tokens, args.top)

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
