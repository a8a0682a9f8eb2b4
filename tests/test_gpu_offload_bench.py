"""scripts/gpu_check and benchmarks/gpu_offload.py on a CPU: every code path in tiny mode, and the arithmetic.

On a GPU machine the script itself is the run that matters (it takes minutes there), so its test here is skipped.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import benchmark_script
from hypothesis import given
from hypothesis import strategies as st

REPO = Path(__file__).resolve().parents[1]
gpu_offload = benchmark_script("gpu_offload")


@pytest.mark.skipif(torch.cuda.is_available(), reason="with CUDA, scripts/gpu_check runs the full GPU benchmark")
def test_gpu_check_on_a_cpu_skips_the_cuda_tests_and_runs_every_benchmark_section(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_TESTS": "tests/test_cache.py", "GPU_CHECK_SECONDS": "400"}
    done = subprocess.run([str(REPO / "scripts" / "gpu_check"), str(tmp_path)], env=env, capture_output=True,
                          check=False, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    names = {path.name for path in tmp_path.iterdir()}
    assert names == {"gpu_check.log", "pytest.log", "pytest_junit.xml", "gpu_offload.log", "gpu_offload.json",
                     "gpu_offload.md", "gpu_offload.png"}
    assert "skipped" in (tmp_path / "pytest.log").read_text() and "passed" not in (tmp_path / "pytest.log").read_text()

    report = json.loads((tmp_path / "gpu_offload.json").read_text())
    assert report["link"]["pinned_gbps"] > 0
    (shape,) = report["shapes"]
    for executor in ("stream", "accelerate", "resident"):
        entry = shape["executors"][executor]
        assert entry["status"] == "measured" and set(entry["seconds"]) == {"1", "16", "64", "256"}
    assert shape["executors"]["stream"]["streamed_bytes"] == shape["parameter_bytes_built"]  # all on disk
    assert {"4", "16"} == set(report["draft"]["budgets"])
    methods = report["end_to_end"]["executors"]["stream"]["methods"]
    assert set(methods) == {"plain generate", "HF assisted", "SpecExec budget 4", "SpecExec budget 16"}
    assert all(row["status"] == "measured" and all(row["equals_in_memory_greedy"]) for row in methods.values())
    (projection,) = report["projections"]
    assert {"plain generate", "SpecExec budget 16"} <= set(projection["executors"]["stream"])
    assert [row["system"].split(",")[0] for row in report["published"]][1:] == [
        "SpecExec paper (Svirschevski et al.", "SpecExec paper (Svirschevski et al.", "UMbreLLa README"]
    assert "errors" not in report
    markdown = (tmp_path / "gpu_offload.md").read_text()
    assert "## End to end" in markdown and "## Projected tokens/s" in markdown and "not normalised" in markdown


@pytest.mark.skipif(importlib.util.find_spec("optimum.quanto") is None, reason="needs optimum-quanto")
def test_quantized_layers_stream_their_packed_bytes(tmp_path):
    """--weights int4: the stream executor and the resident floor run; what streams is the packed int4 layers plus
    the 16-bit head, far below the float layers' bytes; the whole-shape extrapolation scales the layers only."""
    assert gpu_offload.main(["--tiny", "--weights", "int4", "--out", str(tmp_path), "--time-budget", "300"]) == 0
    report = json.loads((tmp_path / "gpu_offload.json").read_text())
    (shape,) = report["shapes"]
    assert shape["dtype"] == "float32, int4 layers" and set(shape["executors"]) == {"stream", "resident"}
    stream = shape["executors"]["stream"]
    assert stream["status"] == "measured" and set(stream["seconds"]) == {"1", "16", "64", "256"}
    config = gpu_offload.SHAPES["tiny"].config()
    float_layers = shape["parameter_bytes_built"] - 2 * config.vocab_size * config.hidden_size * 4 - config.hidden_size * 4
    assert stream["head_bytes"] == config.vocab_size * config.hidden_size * 4
    assert 0 < stream["streamed_bytes"] - stream["head_bytes"] < 0.25 * float_layers
    assert stream["full_shape_seconds"] == stream["seconds"]  # every layer of the tiny shape was built
    assert "errors" not in report


points = st.dictionaries(st.integers(1, 4096), st.floats(1e-3, 10.0), min_size=2, max_size=6)


@given(points=points, data=st.data())
def test_forward_time_is_interpolated_only_between_measured_token_counts(points, data):
    measured = {str(n): s for n, s in points.items()}
    low, high = min(points), max(points)
    tokens = data.draw(st.integers(1, 5000))
    value = gpu_offload.interpolate(measured, tokens)
    if tokens in points:
        assert value == pytest.approx(points[tokens])
    elif not low <= tokens <= high:
        assert value is None
    else:
        below = max(n for n in points if n < tokens)
        above = min(n for n in points if n > tokens)
        assert min(points[below], points[above]) - 1e-12 <= value <= max(points[below], points[above]) + 1e-12


def test_projection_divides_tokens_per_forward_by_target_plus_draft_time():
    shape = {"executors": {"stream": {"status": "measured", "full_shape_seconds": {"1": 0.5, "257": 0.7, "2": 0.5}}}}
    draft = {"one_token_forward_seconds": 0.01, "budgets": {"256": {"seconds_per_draft_forward": 0.004}}}
    rates = {"source": "test", "methods": {
        "SpecExec budget 256": {"tokens_per_target_forward": 4.0, "draft_forwards_per_target_forward": 50.0},
        "HF assisted": {"tokens_per_target_forward": 2.0, "draft_forwards_per_target_forward": 1.0},
        "plain generate": {"tokens_per_target_forward": 1.0, "draft_forwards_per_target_forward": 0.0},
    }}
    rows = gpu_offload.project(shape, draft, rates)["executors"]["stream"]
    assert rows["plain generate"]["tokens_per_second"] == pytest.approx(1 / 0.5)
    assert rows["SpecExec budget 256"]["tokens_per_second"] == pytest.approx(4.0 / (0.7 + 50 * 0.004))
    assert rows["HF assisted"]["tokens_per_second"] == pytest.approx(2.0 / (0.5 + 1 * 0.01))
    ratios = gpu_offload.ratios({"executors": {"stream": rows}})
    assert ratios["SpecExec budget 256 (stream) vs plain generate (stream)"] == pytest.approx(4.0 / 0.9 / 2)


def test_published_figures_are_normalised_only_where_the_source_gives_a_transfer_time():
    rows = gpu_offload.published_comparison({}, {"executors": {}}, 25.0)
    by_weights = {row["weights"]: row for row in rows}
    assert by_weights["16-bit"]["tokens_per_weight_stream"] == [10.0, 15.0]  # 2-3 tok/s x over 5 s
    assert by_weights["4-bit (AWQ)"]["tokens_per_weight_stream"] is None


def test_random_llama_has_random_finite_weights_and_proper_rotary_frequencies():
    shape = gpu_offload.SHAPES["tiny"]
    model = gpu_offload.random_llama(shape, 2, torch.float32)
    reference = gpu_offload.LlamaForCausalLM(shape.config(2))
    for name, parameter in model.named_parameters():
        assert torch.isfinite(parameter).all(), name
        assert parameter.std() > 0 if parameter.dim() > 1 else torch.equal(parameter, torch.ones_like(parameter))
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)  # the same computation
    assert sum(p.nbytes for p in model.parameters()) == shape.parameter_bytes(torch.float32, 2)
    draft = gpu_offload.random_llama(gpu_offload.DRAFT_SHAPES["tiny"], 2, torch.float32)
    assert draft.lm_head.weight is draft.model.embed_tokens.weight


def test_cpu_results_give_the_pairs_rates_for_the_projection():
    rates = gpu_offload.pair_rates_from_cpu_results(REPO / "benchmarks" / "results")
    assert "HF assisted" in rates["methods"] and any(m.startswith("SpecExec budget") for m in rates["methods"])
    assert all(rate["tokens_per_target_forward"] >= 1 for rate in rates["methods"].values())


def test_the_largest_bf16_shape_is_the_biggest_that_fits_host_ram_twice():
    assert gpu_offload.largest_bf16_shape(128 * 2**30).name == "Llama-2-13B"  # 26 GB; CodeLlama-34B needs 148 GB
    assert gpu_offload.largest_bf16_shape(8 * 2**30) is None
