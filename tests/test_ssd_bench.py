"""benchmarks/ssd.py's parts that need no root and no memory cap: the random checkpoint it writes one tensor at a
time, and the goals and projections it computes from measured rows."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from conftest import benchmark_script

ssd = benchmark_script("ssd")
TINY = ssd.LlamaShape("tiny", 64, 128, 2, 4, 2, 256, tied=True)


def test_random_checkpoint_loads_as_the_shape_and_streams_from_disk(tmp_path):
    directory = ssd.write_random_checkpoint(TINY, torch.bfloat16, tmp_path / "tiny")
    stored = load_file(directory / "model.safetensors")
    with torch.device("meta"):
        skeleton = ssd.transformers.LlamaForCausalLM(TINY.config()).to(torch.bfloat16)
    expected = {name: t for name, t in skeleton.state_dict().items() if name != "lm_head.weight"}  # tied
    assert {name: (t.shape, t.dtype) for name, t in stored.items()} == {
        name: (t.shape, t.dtype) for name, t in expected.items()}
    assert all(torch.equal(t, torch.ones_like(t)) for name, t in stored.items() if t.dim() == 1)  # norms at 1
    assert all(0 < t.float().std() < 0.05 for t in stored.values() if t.dim() == 2)  # random, never zeros
    ids = torch.tensor([[5, 9, 17]])
    resident = ssd.transformers.LlamaForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    with ssd.streamed_target(directory, None, prefetch=1) as streamed, torch.no_grad():
        assert torch.equal(streamed(input_ids=ids).logits, resident(input_ids=ids).logits)


def test_goals_and_projection_from_measured_rows():
    rows = [
        {"method": "plain generate", "tokens": [1] * 8, "seconds": 4.0, "target_forwards": 8, "equals_plain_greedy": True},
        {"method": "HF assisted (defaults)", "tokens": [1] * 8, "seconds": 2.0, "target_forwards": 4,
         "equals_plain_greedy": True},
        {"method": "SpecExec budget 16", "tokens": [1] * 8, "seconds": 1.0, "target_forwards": 2, "draft_seconds": 0.2,
         "equals_plain_greedy": True},
        {"method": "SpecExec budget auto", "tokens": [1] * 8, "seconds": 1.25, "target_forwards": 2,
         "draft_seconds": 0.2, "equals_plain_greedy": False},
    ]
    methods = ssd.summarize(rows)
    assert methods["SpecExec budget 16"]["tokens_per_target_forward"] == 4
    assert methods["SpecExec budget 16"]["draft_seconds_per_step"] == pytest.approx(0.1)
    assert not methods["SpecExec budget auto"]["all_equal_plain_greedy"]
    goals = ssd.goals({"end_to_end": {"methods": methods}})
    assert goals["SpecExec budget 16 vs plain generate (goal >= 2.5)"] == pytest.approx(4.0)
    assert goals["SpecExec budget 16 vs the best HF assisted (goal >= 1.4)"] == pytest.approx(2.0)
    assert goals["SpecExec auto vs the best fixed budget (goal >= 0.95)"] == pytest.approx(0.8)
    assert goals["SpecExec budget 16: wall-clock speedup / tokens per target forward (goal >= 0.8)"] == 1.0
    projection = ssd.project({"shape": "big", "seconds": {"1": 2.0, "64": 2.5}}, {"methods": methods})
    assert projection["tokens_per_second"]["plain generate"] == 0.5
    assert projection["tokens_per_second"]["SpecExec budget 16"] == pytest.approx(4 / (2.0 + 0.5 * 16 / 63 + 0.1))
    assert "SpecExec budget auto" not in projection["tokens_per_second"]  # no fixed forward size to project
