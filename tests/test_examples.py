"""The examples run as written, offline: each one's argument parsing, and a short run on the default pair (slow)
that prints its check against plain greedy decoding (or, for vLLM, its speculative-decoding counters)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from tolerances import assert_close_across_kernels, rounding_bound
from transformers import AutoModelForCausalLM

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
RUN_TIMEOUT_S = 900
# Each example's short run and the line that shows it worked.
SHORT_RUNS = {
    "quickstart.py": (
        ["--max-new-tokens", "8", "--runs", "1"], r"identical to plain greedy:\s+True(?s:.*)speedup:\s+[\d.]+x"
    ),
    "pipeline.py": (["--max-new-tokens", "8"], r"identical to the plain pipeline: True"),
    "offload.py": (["--max-new-tokens", "8"], r"identical to plain greedy: HF assisted \S+, SpecExec True"),
    "vllm_offline.py": (
        ["--max-tokens", "8", "--max-model-len", "512", "--enforce-eager"],
        r"acceptance \S+% of proposed tokens, \S+ tokens per target step",
    ),
}


def run_example(name: str, *args: str) -> str:
    """Runs ``examples/<name>`` with ``args`` offline (no hub access); returns its output, failing on an error."""
    result = subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True, timeout=RUN_TIMEOUT_S,
        env={**os.environ, **OFFLINE},
    )  # fmt: skip
    assert result.returncode == 0, f"{name} {' '.join(args)} failed:\n{result.stdout}\n{result.stderr[-4000:]}"
    return result.stdout


def test_every_example_has_a_short_run():
    assert sorted(SHORT_RUNS) == sorted(path.name for path in EXAMPLES.glob("*.py"))


@pytest.mark.parametrize("name", sorted(SHORT_RUNS))
def test_help(name):
    assert run_example(name, "--help").startswith("usage:")


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(set(SHORT_RUNS) - {"vllm_offline.py"}))
def test_short_run(name):
    args, expected = SHORT_RUNS[name]
    assert re.search(expected, run_example(name, *args)), f"{name} did not print /{expected}/"


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_short_run(vllm_env):
    args, expected = SHORT_RUNS["vllm_offline.py"]
    output = run_example("vllm_offline.py", *args)
    assert re.search(expected, output), f"vllm_offline.py did not print /{expected}/:\n{output}"


@pytest.mark.slow
def test_exported_default_draft_scores_as_the_shipped_one(tmp_path):
    """The standalone draft vLLM loads gives the shipped draft's logits on the tokens the shipped head scores, and
    the target's head rows elsewhere."""
    from specexec_hf.models import default_target_dir, export_default_pair, load_default_pair

    target_dir, draft_dir = export_default_pair(tmp_path)
    assert target_dir == default_target_dir()
    target, shipped, _ = load_default_pair(draft_dtype=torch.float32)
    exported = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
    ids = torch.tensor([[1, 504, 3458, 314, 253, 1326, 30]])
    with torch.no_grad():
        expected, logits = shipped(ids).logits, exported(ids).logits
    scored = shipped.get_output_embeddings().token_ids
    # The same layers; the shipped head multiplies its 7 rows in core.products.head_product's order on a CPU.
    bound = rounding_bound(torch.float32, reduction=shipped.config.hidden_size)
    assert_close_across_kernels(logits[..., scored], expected[..., scored], bound)
    others = torch.ones(logits.shape[-1], dtype=torch.bool)
    others[scored] = False
    head = exported.get_output_embeddings().weight
    assert torch.equal(head[others], target.get_output_embeddings().weight[others])
