"""SpecExec's home turf: a target that does not fit in fast memory. The same prompt runs through plain greedy
generate(), Hugging Face assisted generation and SpecExec with SmolLM2-135M-Instruct offloaded:

- with CUDA, the target gets a small GPU budget (--gpu-budget): the modules that fit stay on the GPU, the other
  decoder layers stay in CPU RAM and are streamed to the GPU on every forward; the draft sits on the GPU;
- on a CPU, the target is fully offloaded to disk (every forward reads all its weights again, the embedding only
  for the tokens fed) and the draft sits in RAM.

How much SpecExec gains depends on how expensive a target forward is next to a draft tree. A 135M target streams
in a few milliseconds over a GPU's host link and costs little more per forward from a fast disk (or the page
cache) than in memory, so here SpecExec may well be slower; benchmarks/gpu_offload.py and benchmarks/offload.py
measure where it pays (targets whose forward is dominated by weight reads).

Run: python examples/offload.py [--executor stream|accelerate] [--budget N] [--max-new-tokens N] [--gpu-budget 300MiB]
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
parser.add_argument("--gpu-budget", default="300MiB", help="with CUDA: GPU memory for the target (default 300MiB)")
args = parser.parse_args()
device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")

# The in-memory target only lends the draft its embedding. The offloaded target reads its weights from the
# cached safetensors checkpoint in place, so it needs no offload_folder. On a CPU, max_memory={"cpu": 0} leaves no
# weight in RAM; with CUDA, what does not fit in the GPU budget stays in CPU RAM (far more than the model needs).
_, draft, tokenizer = specexec_hf.load_default_pair()
draft.to(device)
max_memory = {0: args.gpu_budget, "cpu": "32GiB"} if device.type == "cuda" else {"cpu": 0}
try:
    target = load_offloaded(target_cache_dir(), max_memory=max_memory, executor=args.executor)
except NotImplementedError as error:  # an executor without a CUDA path in this version
    raise SystemExit(f"{error}\nRun with --executor accelerate instead.") from error
streamed = [name for name, where in target.hf_device_map.items() if where in ("cpu", "disk")]
where = "in CPU RAM, streamed to the GPU" if device.type == "cuda" else "on disk, read"
print(f"Target: {len(streamed)} weight modules {where} on every forward (executor={args.executor!r})")
inputs = tokenizer.apply_chat_template(
    [{"role": "user", "content": args.prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
).to(device)
prompt_length = inputs["input_ids"].shape[1]
if device.type == "cuda":  # CUDA context and kernel selection, so that the first method timed does not pay them
    target.generate(**inputs, max_new_tokens=2, do_sample=False)


def run(name: str, **kwargs) -> torch.Tensor | None:
    """Generates greedily, prints tokens/s, and returns the new tokens (``None`` if the method fails)."""
    started = time.perf_counter()
    try:
        output = target.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, **kwargs)
    except Exception as error:  # transformers' assisted generation fails on an all-meta accelerate model
        print(f"{name:<28} fails: {type(error).__name__}: {error}")
        return None
    new = output[0, prompt_length:].cpu()  # waits for the GPU, so the time below is the whole generation
    seconds = time.perf_counter() - started
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
