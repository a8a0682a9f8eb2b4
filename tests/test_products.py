"""``core.products.head_product``: ``F.linear`` up to rounding, and ``F.linear`` itself where it does not apply."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from tolerances import assert_close_across_kernels, rounding_bound

from specexec_hf.core.products import head_product


@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(0, 40),
    widths=st.tuples(st.integers(1, 96), st.integers(1, 200)),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_head_product_is_f_linear_up_to_rounding(seed, rows, widths, dtype):
    generator = torch.Generator().manual_seed(seed)
    inputs, outputs = widths
    hidden = torch.randn(rows, inputs, generator=generator).to(dtype)
    weight = torch.randn(outputs, inputs, generator=generator).to(dtype)
    got, expected = head_product(hidden, weight), F.linear(hidden, weight)
    assert got.shape == expected.shape and got.dtype == dtype and got.is_contiguous()
    if dtype != torch.float32 or rows < 2:
        assert torch.equal(got, expected)  # F.linear itself
    else:
        assert_close_across_kernels(got, expected, rounding_bound(dtype, reduction=inputs))
