"""Option (a) and (b) for strict 16-bit identity, measured at commit 60d9779 (the only commit with ``strict_ties``).

(a) ``strict_ties=True``: the walk stops before a near-tied choice and the next step decides it alone, from a forward
over that one token (plain decoding's shape). (b) every target choice from a float32 LM head on the 16-bit hidden state
(a superset of re-deciding near-tied nodes in float32: elsewhere the choice cannot change). Each run starts from fresh
acceptance maps. Prints one JSON line per (model, prompt, option): the first position where the output differs from
plain greedy in the same dtype (None: identical), target forwards and seconds.

    git checkout 60d9779 -- specexec_hf   # in a scratch worktree
    OMP_NUM_THREADS=1 python benchmarks/results/precision_flips/strict_options_at_60d9779.py > strict_options.jsonl
"""

import json
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import specexec_hf
from specexec_hf import SpecExecStats
from specexec_hf.hf.calibrated import separate_acceptance_maps

NEW_TOKENS = 40


class Float32Head(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = weight

    def forward(self, hidden):
        return torch.nn.functional.linear(hidden.float(), self.weight.float())


def random_llama(seed):
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=None,
        eos_token_id=None, pad_token_id=None,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)  # peaked next-token distributions, as a trained model's
    return model.to(torch.bfloat16)


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def run(name, target, draft, prompts, budget):
    head = target.lm_head
    for k, ids in enumerate(prompts):
        length = ids.shape[1]
        reference = target.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False)[0, length:].tolist()
        for option in ("none", "a_strict_ties", "b_float32_head"):
            target.lm_head = Float32Head(head.weight) if option == "b_float32_head" else head
            stats, started = SpecExecStats(), time.perf_counter()
            with separate_acceptance_maps(draft, {}):
                out = target.generate(
                    ids, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=draft, speculator="specexec",
                    budget=budget, specexec_stats=stats, strict_ties=option == "a_strict_ties",
                )[0, length:].tolist()
            target.lm_head = head
            print(json.dumps({
                "model": name, "prompt": k, "option": option, "differs_at": first_difference(reference, out),
                "target_forwards": stats.target_forwards, "new_tokens": len(out),
                "seconds": round(time.perf_counter() - started, 2),
            }), flush=True)


def main():
    which = sys.argv[1] if len(sys.argv) > 1 else "all"
    if which in ("all", "tiny"):
        target, other = random_llama(0), random_llama(1)
        prompts = [torch.randint(0, 2048, (1, 16), generator=torch.Generator().manual_seed(k)) for k in range(4)]
        run("random-llama draft=target", target, target, prompts, 16)
        run("random-llama random draft", target, other, prompts, 16)
    if which in ("all", "default"):
        target, draft, tokenizer = specexec_hf.load_default_pair()
        target, draft = target.to(torch.bfloat16), draft.to(torch.bfloat16)
        texts = ["The capital of France is", "def fibonacci(n):", "Explain why the sky is blue.",
                 "List three uses of copper.", "Once upon a time"]
        prompts = [tokenizer(text, return_tensors="pt").input_ids for text in texts]
        run("SmolLM2-135M + shipped draft", target, draft, prompts, 32)


if __name__ == "__main__":
    main()
