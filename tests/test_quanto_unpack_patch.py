"""The quanto_unpack patch: quanto's portable unpack kernel registered for CUDA, idempotent and reversible.

The CUDA dispatch key is reached here by redispatching CPU tensors to it, so the kernel the patch registers runs on
a machine without a GPU; tests/test_cuda_executor.py runs the int4 streamed target on a real one with it applied.
"""

from __future__ import annotations

import pytest
import torch
from conftest import importable
from hypothesis import given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.skipif(not importable("optimum.quanto"), reason="needs optimum-quanto")

CUDA_KEY = torch._C.DispatchKeySet(torch._C.DispatchKey.CUDA)


def cuda_kernel_registered() -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key("quanto::unpack", "CUDA")


@pytest.fixture
def patch():
    import optimum.quanto  # noqa: F401

    from specexec_hf.patches import quanto_unpack

    quanto_unpack.revert()
    before = cuda_kernel_registered()
    yield quanto_unpack, before
    quanto_unpack.revert()


@settings(max_examples=25, deadline=None)
@given(rows=st.integers(1, 40), columns=st.integers(1, 40), bits=st.sampled_from([2, 4]), seed=st.integers(0, 2**16))
def test_the_cuda_kernel_gives_the_integers_of_quantos_cpu_kernel(rows, columns, bits, seed):
    import optimum.quanto  # noqa: F401

    from specexec_hf.patches import quanto_unpack

    quanto_unpack.apply()
    try:
        generator = torch.Generator().manual_seed(seed)
        packed = torch.randint(0, 256, (rows, columns), dtype=torch.uint8, generator=generator)
        on_cuda_key = torch.ops.quanto.unpack.default.redispatch(CUDA_KEY, packed, bits)
        assert on_cuda_key.dtype == torch.uint8
        assert torch.equal(on_cuda_key, torch.ops.quanto.unpack(packed, bits))
        assert on_cuda_key.shape == (rows * 8 // bits, columns)
    finally:
        quanto_unpack.revert()


def test_apply_is_idempotent_and_revert_restores_the_kernels_there_were(patch):
    quanto_unpack, before = patch
    quanto_unpack.apply()
    quanto_unpack.apply()
    assert quanto_unpack.is_applied() and cuda_kernel_registered()
    quanto_unpack.revert()
    assert not quanto_unpack.is_applied()
    assert cuda_kernel_registered() == before
    quanto_unpack.revert()
    assert cuda_kernel_registered() == before


@pytest.mark.parametrize("version", ["0.1.0", "0.3.0", "1.0.0"])
def test_another_quanto_release_line_is_refused_naming_the_fix(version):
    from specexec_hf.patches import quanto_unpack

    refused = r"found optimum\.quanto " + version.replace(".", r"\.") + r".*optimum-quanto==0\.2\.7"
    with pytest.raises(RuntimeError, match=refused):
        quanto_unpack.QUANTO.check(version)
    quanto_unpack.QUANTO.check("0.2.7")
