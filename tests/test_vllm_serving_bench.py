"""benchmarks/vllm_serving.py on the synthetic tiny pair: three `vllm serve` runs (none, draft_model, SpecExec trees)
whose greedy texts must agree, with speculation that commits more than one token per target step.

Each server takes 40-60 s to start on the 2-core CPU machine, so this module takes about 3 minutes.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import benchmark_script

vllm_serving = benchmark_script("vllm_serving")

pytestmark = pytest.mark.slow


def test_serving_benchmark_on_the_tiny_pair(vllm_env, tmp_path):
    output = tmp_path / "serving.json"
    vllm_serving.main(
        ["--requests", "4", "--concurrency", "2", "--max-tokens", "16", "--budgets", "16", "-k", "4",
         "--output", str(output)]
    )  # fmt: skip
    report = json.loads(output.read_text())
    assert (report["concurrency"], report["requests"], report["max_tokens"]) == (2, 4, 16)
    results = {(r["method"], r["budget"]): r for r in report["results"]}
    assert set(results) == {("none", None), ("draft_model", None), ("specexec_tree", 16)}
    for (method, _), result in results.items():
        assert result["outputs_equal_none"] is True, method
        assert result["completion_tokens"] == 4 * 16
        assert all(request["text"] for request in result["requests"])
        assert result["output_tokens_per_s"] > 0 and result["mean_latency_s"] > 0
        assert Path(result["log"]).is_file()
    assert results[("none", None)]["drafts"] == 0
    for key in (("draft_model", None), ("specexec_tree", 16)):
        assert results[key]["tokens_per_target_step"] > 1
        assert results[key]["delivered_tokens_per_step"] > 1
