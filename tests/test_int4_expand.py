"""Quantized (optimum-quanto) linear weights streamed packed and expanded into their compute dtype in the device
ring (``specexec_hf.offload.expand``): the expansion is bit-equal to quanto's ``dequantize()``, and the device
executor, run on the CPU through ``OrderCheckingDevice``, computes what the in-memory model whose quantized weights
are replaced by their dequantized dense weights computes, with the expansion ordered between its slot's upload and
the next upload into that slot."""

from __future__ import annotations

import pytest
import torch
from conftest import importable
from hypothesis import given, settings
from hypothesis import strategies as st

from specexec_hf.offload.expand import PackedWeight, expand_into, expandable, packed_weight

pytestmark = pytest.mark.skipif(not importable("optimum.quanto"), reason="needs optimum-quanto")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def quantized_weight(
    rows: int, columns: int, dtype: torch.dtype, group_size: int | None, zero_point: bool, seed: int
) -> torch.Tensor:
    """A quanto int4 weight, in the layout quanto picks for it on the CPU (TinyGemm for bfloat16 in groups of 128,
    its generic packing otherwise); ``group_size`` ``None``: one group per row, as quanto quantizes narrow layers."""
    from optimum.quanto import MaxOptimizer, qint4, quantize_weight

    base = torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed)).to(dtype)
    scale, shift = MaxOptimizer()(base, qtype=qint4, axis=0, group_size=group_size, zeropoint=zero_point)
    return quantize_weight(base, qtype=qint4, axis=0, scale=scale, shift=shift, group_size=group_size)


def int8_weight(rows: int, columns: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    from optimum.quanto import AbsmaxOptimizer, qint8, quantize_weight

    base = torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return quantize_weight(base, qtype=qint8, axis=0, scale=AbsmaxOptimizer()(base, qtype=qint8, axis=0))


def expanded(weight: PackedWeight) -> torch.Tensor:
    dense = torch.full(weight.shape, float("nan"), dtype=weight.dtype)  # nothing left unwritten passes
    expand_into(weight, dense)
    return dense


@st.composite
def int4_weights(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    group_size = draw(st.sampled_from([32, 64, 96, 128, None]))
    columns = (group_size or 8) * draw(st.integers(1, 3))
    tinygemm = dtype == torch.bfloat16 and group_size == 128  # torch's CPU int4 packer: rows in multiples of 16
    rows = 16 * draw(st.integers(1, 3)) if tinygemm else draw(st.integers(1, 40))
    zero_point = not tinygemm and draw(st.booleans())  # quanto's TinyGemm takes float shifts only
    return quantized_weight(rows, columns, dtype, group_size, zero_point, draw(st.integers(0, 2**16)))


@settings(max_examples=60)
@given(weight=int4_weights())
def test_expansion_is_bit_equal_to_quantos_dequantize(weight):
    packed = packed_weight(weight)
    assert packed.packed.dtype == torch.uint8 and packed.packed.numel() == -(-packed.groups // 2) * packed.group_size
    assert torch.equal(expanded(packed), weight.dequantize())


@settings(max_examples=20)
@given(
    rows=st.integers(2, 40), columns=st.integers(1, 300), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16)
)  # a single row is quantized per tensor (axis None), which stays unexpanded
def test_int8_expansion_is_bit_equal_to_quantos_dequantize(rows, columns, dtype, seed):
    weight = int8_weight(rows, columns, dtype, seed)
    assert torch.equal(expanded(packed_weight(weight)), weight.dequantize())


def test_a_generic_weight_is_taken_as_views_of_its_own_inner_tensors():
    weight = quantized_weight(20, 256, torch.float32, 128, False, 0)
    packed = packed_weight(weight)
    assert packed.packed.data_ptr() == weight._data._data.data_ptr()
    assert packed.scale.data_ptr() == weight._scale.data_ptr() and packed.shift.data_ptr() == weight._shift.data_ptr()


def test_every_value_and_both_nibbles_reach_the_dense_weight():
    """Each position takes its own nibble: a weight whose values are their own positions modulo 16."""
    from optimum.quanto import WeightQBitsTensor, qint4

    groups, group_size = 5, 32
    values = (torch.arange(groups * group_size) % 16).to(torch.uint8).view(groups, group_size)
    scale = torch.ones(groups, 1)
    shift = torch.zeros(groups, 1)
    weight = WeightQBitsTensor(qint4, 0, group_size, (groups, group_size), (group_size, 1), values, scale, shift)
    assert torch.equal(expanded(packed_weight(weight)), values.float())


def test_a_weight_that_does_not_expand_is_refused_naming_the_setting():
    assert not expandable(torch.zeros(4, 4)) and not expandable(torch.nn.Parameter(torch.zeros(4, 4)))
    with pytest.raises(ValueError, match="expand_quantized=False"):
        packed_weight(torch.zeros(4, 4))


def test_a_dense_buffer_of_another_shape_or_dtype_is_refused():
    packed = packed_weight(quantized_weight(4, 64, torch.float32, 32, False, 0))
    with pytest.raises(ValueError, match=r"expands into a contiguous \[4, 64\] torch.float32"):
        expand_into(packed, torch.empty(4, 64, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        expand_into(packed, torch.empty(64, 4).t())
