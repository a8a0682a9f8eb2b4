"""SpecExec's home turf: a target that does not fit in fast memory. Here SmolLM2-135M-Instruct is fully
offloaded to disk on a CPU (every forward reads all its weights again, the embedding only for the tokens fed),
the distilled draft sits in RAM, and the same prompt runs through plain greedy generate(), Hugging Face assisted
generation and SpecExec.

How much SpecExec gains depends on how expensive a target forward is next to a draft tree. A 135M target read
from a fast disk (or the page cache) costs little more per forward than in memory, while a tree forward on a CPU
grows with its tokens, so here SpecExec may well be slower; benchmarks/offload.py measures both effects.

Run: python examples/offload.py [--executor stream|accelerate] [--budget N] [--max-new-tokens N]
"""

from __future__ import annotations

import argparse
import time

import torch

import specexec_hf
from specexec_hf.models import target_cache_dir
from specexec_hf.offload import load_offloaded

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--executor", choices=["stream", "accelerate"], default="stream", help="offload executor")
parser.add_argument("--budget", type=int, default=16, help="draft tokens per tree (default 16)")
parser.add_argument("--max-new-tokens", type=int, default=48, help="answer length (default 48)")
parser.add_argument("--prompt", default="Explain in three sentences why the sky is blue.", help="chat message")
args = parser.parse_args()

# The in-memory target only lends the draft its embedding. The offloaded target reads its weights from the
# cached safetensors checkpoint in place, so it needs no offload_folder; max_memory={"cpu": 0} leaves no weight in RAM.
_, draft, tokenizer = specexec_hf.load_default_pair()
target = load_offloaded(target_cache_dir(), max_memory={"cpu": 0}, executor=args.executor)
on_disk = [name for name, where in target.hf_device_map.items() if where == "disk"]
print(f"Target: {len(on_disk)} weight modules on disk, read on every forward (executor={args.executor!r})")
inputs = tokenizer.apply_chat_template(
    [{"role": "user", "content": args.prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
)
prompt_length = inputs["input_ids"].shape[1]


def run(name: str, **kwargs) -> torch.Tensor | None:
    """Generates greedily, prints tokens/s, and returns the new tokens (``None`` if the method fails)."""
    started = time.perf_counter()
    try:
        output = target.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, **kwargs)
    except Exception as error:  # transformers' assisted generation fails on an all-meta accelerate model
        print(f"{name:<28} fails: {type(error).__name__}: {error}")
        return None
    seconds = time.perf_counter() - started
    new = output[0, prompt_length:]
    print(f"{name:<28} {len(new) / seconds:6.2f} tok/s  ({seconds:.1f} s)")
    return new


plain = run("plain greedy generate()")
assisted = run("HF assisted generation", assistant_model=draft)
stats = specexec_hf.SpecExecStats()
fast = run(f"SpecExec (budget {args.budget})", assistant_model=draft, speculator="specexec", budget=args.budget,
           specexec_stats=stats)
print(f"SpecExec: {stats.tokens_per_target_forward:.2f} tokens per target forward")
assisted_same = "n/a" if assisted is None else torch.equal(plain, assisted)
print(f"identical to plain greedy: HF assisted {assisted_same}, SpecExec {torch.equal(plain, fast)}")
print(f"\nPrompt: {args.prompt}\n\n{tokenizer.decode(fast, skip_special_tokens=True)}")
