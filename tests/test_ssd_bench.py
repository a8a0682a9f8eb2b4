"""benchmarks/ssd.py without root or a memory cap: the random checkpoint it writes one tensor at a time, the bound's
file, the goals and projections it computes from measured rows, its arguments, and a --quick --no-cap run of
every section."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from specexec_hf.offload.direct_io import WeightFile, aligned_empty

from benchmarks import shapes, ssd
from benchmarks.report import goals_by_key

TINY = shapes.LlamaShape("tiny", 64, 128, 2, 4, 2, 256, tied=True)


def test_random_checkpoint_loads_as_the_shape_and_streams_from_disk(tmp_path):
    directory = shapes.write_random_checkpoint(TINY, torch.bfloat16, tmp_path / "tiny")
    stored = load_file(directory / "model.safetensors")
    with torch.device("meta"):
        skeleton = LlamaForCausalLM(TINY.config()).to(torch.bfloat16)
    expected = {name: t for name, t in skeleton.state_dict().items() if name != "lm_head.weight"}  # tied
    assert {name: (t.shape, t.dtype) for name, t in stored.items()} == {
        name: (t.shape, t.dtype) for name, t in expected.items()}
    assert all(torch.equal(t, torch.ones_like(t)) for name, t in stored.items() if t.dim() == 1)  # norms at 1
    assert all(0 < t.float().std() < 0.05 for t in stored.values() if t.dim() == 2)  # random, never zeros
    ids = torch.tensor([[5, 9, 17]])
    resident = LlamaForCausalLM.from_pretrained(directory, dtype=torch.bfloat16).eval()
    with ssd.streamed_target(directory, None, prefetch=1) as (streamed, _), torch.no_grad():
        assert torch.equal(streamed(input_ids=ids).logits, resident(input_ids=ids).logits)


def test_goals_and_projection_from_measured_rows():
    rows = [
        {"method": "plain generate", "tokens": [1] * 8, "seconds": 4.0, "target_forwards": 8,
         "equals_plain_greedy": True},
        {"method": "HF assisted (defaults)", "tokens": [1] * 8, "seconds": 2.0, "target_forwards": 4,
         "equals_plain_greedy": True},
        {"method": "SpecExec budget 16", "tokens": [1] * 8, "seconds": 1.0, "target_forwards": 2, "tree_seconds": 0.2,
         "verify_seconds": 0.7, "equals_plain_greedy": True},
        {"method": "SpecExec budget auto", "tokens": [1] * 8, "seconds": 1.25, "target_forwards": 2,
         "tree_seconds": 0.2, "verify_seconds": 0.9, "equals_plain_greedy": False},
    ]
    methods = ssd.summarize(rows)
    assert methods["SpecExec budget 16"]["tokens_per_target_forward"] == 4
    assert methods["SpecExec budget 16"]["draft_seconds_per_step"] == pytest.approx(0.1)
    assert methods["SpecExec budget 16"]["verify_seconds_per_step"] == pytest.approx(0.35)
    assert methods["SpecExec budget 16"]["seconds_per_step"] == pytest.approx(0.5)
    assert not methods["SpecExec budget auto"]["all_equal_plain_greedy"]
    goals = goals_by_key(ssd.goals({"end_to_end": {"methods": methods}}))
    assert goals["specexec_vs_plain"].measured == pytest.approx(4.0) and goals["specexec_vs_plain"].met
    assert goals["specexec_vs_plain"].claim == "SpecExec budget 16 vs plain generate"
    assert goals["specexec_vs_assisted"].measured == pytest.approx(2.0)
    assert goals["auto_vs_best_budget"].measured == pytest.approx(0.8) and not goals["auto_vs_best_budget"].met
    assert goals["speedup_over_tokens_per_forward"].measured == 1.0
    capped = goals_by_key(ssd.goals({"end_to_end": {"methods": methods, "peak_bytes": 900, "limit_bytes": 1000}}))
    assert capped["peak_over_cap"].measured == 0.9 and capped["peak_over_cap"].met  # at most the cap
    assert ssd.goals({"end_to_end": None, "forward": []}) == []  # a failed section leaves no goal, and no crash
    projection = ssd.project({"shape": "big", "seconds": {"1": 2.0, "64": 2.5}}, {"methods": methods})
    assert projection["tokens_per_second"]["plain generate"] == 0.5
    assert projection["tokens_per_second"]["SpecExec budget 16"] == pytest.approx(4 / (2.0 + 0.5 * 16 / 63 + 0.1))
    assert "SpecExec budget auto" not in projection["tokens_per_second"]  # no fixed forward size to project


@pytest.mark.slow
def test_quick_run_measures_every_section_and_deletes_its_shapes(tmp_path):
    """The smoke path: every section, small (the real default pair end to end, so marked slow)."""
    out, shapes = tmp_path / "out", tmp_path / "shapes"
    # Without a cap, prefetch="auto" would hold every weight in the ring and stream nothing.
    arguments = ["--quick", "--no-cap", "--prefetch", "1", "--end-to-end-prefetch", "1", "--threads", "1",
                 "--out", str(out), "--shape-dir", str(shapes)]
    assert ssd.main(arguments) == 0
    report = json.loads((out / "ssd.json").read_text())
    assert {path.name for path in out.iterdir()} == {"ssd.json", "ssd.md", "ssd.png"}
    assert report["bound"]["direct_gbps"] > 0 and report["bound"]["bytes"] >= ssd.QUICK["bound_min_bytes"]
    measured = {(row["shape"], row["dtype"]): row for row in report["forward"]}
    assert set(measured) == {(ssd.DEFAULT_TARGET, "float32"), ("tiny Llama", "bfloat16"), ("tiny Llama", "float32"),
                             ("tiny Llama", "int4")}
    assert all(set(row["seconds"]) == {"1", "4"} and row["share_of_bound"]["1"] > 0 for row in measured.values())
    # The int4 row streams its packed layers from the folder the library wrote: fewer bytes than the bf16 layers.
    assert measured["tiny Llama", "int4"]["streamed_bytes"] < measured["tiny Llama", "bfloat16"]["streamed_bytes"]
    assert all(method["all_equal_plain_greedy"] for method in report["end_to_end"]["methods"].values())
    assert "SpecExec budget auto" in report["end_to_end"]["methods"]
    [auto] = report["end_to_end"]["auto_budget"]  # what "auto" chose with, for reading its choices against the rows
    assert int(auto["choice"]) in map(int, auto["modelled_tokens_per_second"])
    assert all(size >= 1 for row in report["end_to_end"]["rows"] for size in row.get("tree_sizes", [1]))
    assert os.listdir(shapes) == []  # the tiny checkpoint and the bound's scratch file are gone


def test_bound_reads_the_longest_file_and_the_scratch_file_buffered(tmp_path):
    short, long = tmp_path / "short.bin", tmp_path / "long.bin"
    short.write_bytes(os.urandom(1 << 20))
    long.write_bytes(os.urandom(3 << 20))
    scratch = ssd.write_scratch_file(tmp_path / "scratch.bin", 2 << 20)
    assert scratch.stat().st_size == 2 << 20
    result = ssd.bound([short, long], 1, scratch)
    assert result["file"] == str(long) and result["bytes"] == 3 << 20 and result["direct_gbps"] > 0
    assert result["buffered_bytes"] == 2 << 20
    assert ssd.bound([short], 1, scratch)["file"] == str(scratch)  # every streamed file shorter than the scratch


def test_block_device_reads_count_a_direct_read_of_a_file_on_that_device(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(os.urandom(1 << 20))
    reads = ssd.block_device_reads(path)
    if reads is None:
        pytest.skip(f"{tmp_path} is on no block device with a /sys/dev/block entry (overlay, tmpfs)")
    before = reads()
    file = WeightFile(path)
    if not file.direct:
        pytest.skip("no O_DIRECT here")
    file.read(0, aligned_empty(1 << 20))
    requests, nbytes = (after - earlier for after, earlier in zip(reads(), before))
    assert requests >= 1 and nbytes >= 1 << 20  # other processes' reads of the device may add to both


def test_forward_goals_name_the_largest_weights_over_cap_and_whether_it_stayed_within():
    def row(shape, over, peak, limit=1000, seconds=None, dtype="bfloat16", flat=64):
        seconds = seconds or {"1": 1.0, "64": 1.2}
        return {"shape": shape, "dtype": dtype, "capped": True, "weights_over_limit": over, "peak_bytes": peak,
                "limit_bytes": limit, "within_limit": peak <= limit, "seconds": seconds,
                "share_of_bound": {"1": 0.9}, "over_one_token": {n: s / seconds["1"] for n, s in seconds.items()},
                "flat_tokens": flat}

    curves = [row(ssd.DEFAULT_TARGET, 0.7, 900), row("SmolLM2-1.7B", 2.6, 1001e6, limit=1000e6),
              row("SmolLM2-1.7B", 1.3, 900, dtype="float32", flat=16),
              {"shape": "SmolLM2-1.7B", "dtype": "int4", "not_run": "refused"}]
    goals = goals_by_key(ssd.forward_goals(curves))
    assert goals["default_target_64_over_1"].measured == pytest.approx(1.2) and goals["default_target_64_over_1"].met
    assert goals["larger_bfloat16_flat_tokens"].measured == 64
    assert goals["larger_bfloat16_one_token_share_of_bound"].measured == 0.9
    assert goals["larger_float32_flat_tokens"].measured == 16  # the same shape computed in float32
    assert not goals["larger_float32_flat_tokens"].met
    cap = goals["weights_over_cap"]
    assert cap.claim.startswith("SmolLM2-1.7B bfloat16") and "OVER the 1000 MB cap" in cap.claim and cap.measured == 2.6


def test_arguments_quick_defaults_and_prefetch(capsys):
    args = ssd.parse_args(["--quick", "--prompts", "3"])
    assert (args.prompts, args.shapes, args.budgets) == (3, ["tiny"], [8, "auto"])  # given options win
    assert ssd.parse_args(["--prefetch", "auto"]).prefetch == "auto"
    assert ssd.parse_args(["--prefetch", "2"]).prefetch == 2
    assert ssd.parse_args([]).prefetch == ssd.prefetch_value(ssd.DEFAULT_PREFETCH)
    assert ssd.parse_args(["--end-to-end-prefetch", "auto"]).end_to_end_prefetch == "auto"
    assert ssd.parse_args([]).end_to_end_prefetch == ssd.END_TO_END_PREFETCH
    for bad in ("0", "two"):
        with pytest.raises(SystemExit):
            ssd.parse_args(["--prefetch", bad])
        assert "--prefetch takes a positive integer or 'auto'" in capsys.readouterr().err


def test_int8_draft_methods_share_the_float_draft_s_embedding_and_leave_its_head():
    from conftest import tiny_model

    from specexec_hf.models.int8_draft import Int8LlamaDecoderLayer, Int8LMHead

    draft = tiny_model("llama", dtype=torch.float32)
    compared = ssd.methods(draft, ssd.parse_args(["--budgets", "8", "16", "--draft-int8"]))
    assert [name for name in compared if "int8" in name] == ["SpecExec budget 8, int8 draft",
                                                             "SpecExec budget 16, int8 draft"]
    int8 = compared["SpecExec budget 8, int8 draft"]["assistant_model"]
    assert int8 is compared["SpecExec budget 16, int8 draft"]["assistant_model"] is not draft
    assert all(type(layer) is Int8LlamaDecoderLayer for layer in int8.model.layers)
    assert type(draft.model.layers[0]) is not Int8LlamaDecoderLayer
    assert int8.get_input_embeddings() is draft.get_input_embeddings()
    assert type(int8.get_output_embeddings()) is Int8LMHead
    assert type(draft.get_output_embeddings()) is torch.nn.Linear
    assert not any("int8" in name for name in ssd.methods(draft, ssd.parse_args(["--budgets", "8"])))
