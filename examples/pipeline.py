"""An existing text-generation pipeline switched to SpecExec by adding two arguments.

Run: python examples/pipeline.py [--max-new-tokens N]
"""

from __future__ import annotations

import argparse

from transformers import pipeline

import specexec_hf  # installs speculator="specexec" in generate(), which pipelines call

parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
parser.add_argument("--max-new-tokens", type=int, default=48, help="answer length (default 48)")
args = parser.parse_args()

target, draft, tokenizer = specexec_hf.load_default_pair()
chat = pipeline("text-generation", model=target, tokenizer=tokenizer)
messages = [{"role": "user", "content": "Name three famous bridges and where they are."}]

before = chat(messages, max_new_tokens=args.max_new_tokens, do_sample=False)
after = chat(
    messages, max_new_tokens=args.max_new_tokens, do_sample=False, assistant_model=draft, speculator="specexec"
)  # + 2 args

print(after[0]["generated_text"][-1]["content"])
print("\nidentical to the plain pipeline:", after == before)
