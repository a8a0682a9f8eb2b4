"""The quanto_tinygemm_cpu patch: CPU-packed int4 weights unpack to quanto's integers with no identity product."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import importable
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(not importable("optimum.quanto"), reason="needs optimum-quanto")


@pytest.fixture
def patch():
    from specexec_hf.patches import quanto_tinygemm_cpu

    quanto_tinygemm_cpu.revert()
    yield quanto_tinygemm_cpu
    quanto_tinygemm_cpu.revert()


def refuse_identity_products(monkeypatch):
    def refused(*args, **kwargs):
        raise AssertionError("unpacked through torch's int4 CPU matmul")

    monkeypatch.setattr(torch, "_weight_int4pack_mm_for_cpu", refused)


@settings(max_examples=20, deadline=None)
@given(row_blocks=st.integers(1, 9), column_blocks=st.integers(1, 6), seed=st.integers(0, 2**16))
def test_unpacking_gives_quantos_integers_for_any_shape_and_values(row_blocks, column_blocks, seed):
    from optimum.quanto.tensor.weights.tinygemm.packed import TinyGemmPackedTensor

    from specexec_hf.patches import quanto_tinygemm_cpu

    generator = torch.Generator().manual_seed(seed)
    values = torch.randint(0, 16, (16 * row_blocks, 64 * column_blocks), dtype=torch.uint8, generator=generator)
    packed = TinyGemmPackedTensor.pack(values)
    quanto_tinygemm_cpu.revert()
    quantos = packed.unpack()
    quanto_tinygemm_cpu.apply()
    try:
        assert torch.equal(packed.unpack(), values)
        assert torch.equal(quantos, values)
    finally:
        quanto_tinygemm_cpu.revert()


def test_a_quantized_linear_leaves_the_cpu_layout_with_the_same_weights_and_no_identity_product(patch, monkeypatch):
    """The path of ``.to("cuda")``: the TinyGemm weight becomes quanto's portable form first."""
    from optimum import quanto

    linear = torch.nn.Linear(256, 48, bias=False, dtype=torch.bfloat16)
    torch.nn.init.normal_(linear.weight, generator=torch.Generator().manual_seed(3))
    model = torch.nn.Sequential(linear)
    quanto.quantize(model, weights=quanto.qint4)
    quanto.freeze(model)
    weight = model[0].weight
    assert type(weight).__name__ == "TinyGemmWeightQBitsTensor"
    expected = weight.weight_qbits_tensor().dequantize()
    patch.apply()
    refuse_identity_products(monkeypatch)
    portable = weight.weight_qbits_tensor()
    assert type(portable).__name__ == "WeightQBitsTensor"
    assert torch.equal(portable.dequantize(), expected)


def test_weights_packed_for_another_device_keep_quantos_own_unpack(patch, monkeypatch):
    from types import SimpleNamespace

    from optimum.quanto.tensor.weights.tinygemm.packed import TinyGemmPackedTensor

    calls = []
    monkeypatch.setattr(TinyGemmPackedTensor, "unpack", lambda self: calls.append(self) or "quanto's")
    patch.apply()
    try:
        on_gpu = SimpleNamespace(_data=torch.empty(0, device="meta"))  # device type other than "cpu"
        assert TinyGemmPackedTensor.unpack(on_gpu) == "quanto's" and calls == [on_gpu]
    finally:
        patch.revert()


def test_apply_is_idempotent_and_revert_restores_quantos_method(patch):
    from optimum.quanto.tensor.weights.tinygemm.packed import TinyGemmPackedTensor

    original = TinyGemmPackedTensor.unpack
    patch.apply()
    patched = TinyGemmPackedTensor.unpack
    patch.apply()
    assert patch.is_applied() and TinyGemmPackedTensor.unpack is patched is not original
    patch.revert()
    patch.revert()
    assert not patch.is_applied() and TinyGemmPackedTensor.unpack is original


@pytest.mark.parametrize("version", ["0.1.0", "0.3.0"])
def test_another_quanto_release_line_is_refused_naming_the_fix(version, monkeypatch, patch):
    import optimum.quanto

    monkeypatch.setattr(optimum.quanto, "__version__", version)
    refused = r"quanto_tinygemm_cpu .*found optimum\.quanto " + version.replace(".", r"\.") + ".*0\\.2\\.7"
    with pytest.raises(RuntimeError, match=refused):
        patch.apply()
    assert not patch.is_applied()


def test_a_shape_the_bytes_cannot_hold_is_refused_naming_it():
    from specexec_hf.patches.quanto_tinygemm_cpu import unpack_cpu_int4pack

    packed = torch._convert_weight_to_int4pack_for_cpu(torch.zeros(16, 64, dtype=torch.int32), innerKTiles=2)
    with pytest.raises(ValueError, match=r"cannot hold a \[16, 128\] int4 weight"):
        unpack_cpu_int4pack(packed, 16, 128)


def test_the_benchmark_times_both_unpacks_and_compares_their_integers(tmp_path, monkeypatch, patch):
    from benchmarks import quanto_cpu_unpack as bench

    monkeypatch.setattr("sys.argv", ["quanto_cpu_unpack.py", "--shapes", "48x256", "64x512", "--quanto-max-elements",
                                     "12288", "--out", str(tmp_path)])
    bench.main()
    report = json.loads((tmp_path / "quanto_cpu_unpack.json").read_text())
    small, large = report["rows"]
    assert small["same_integers"] is True and small["quanto_seconds"] > 0  # 48 x 256: within the quanto limit
    assert "quanto_seconds" not in large and large["patched_seconds"] > 0
    assert "| 64 x 512 |" in (tmp_path / "quanto_cpu_unpack.md").read_text()
    assert not patch.is_applied()  # the benchmark leaves quanto as it found it
