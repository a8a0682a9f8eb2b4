"""optimum-quanto unpacks 4- and 2-bit weights on a CUDA device without compiling its CUDA extension.

optimum-quanto 0.2 registers ``quanto::unpack`` for CUDA as a call into ``quanto_cuda``, an extension it builds
with nvcc and ninja the first time a packed weight is unpacked on a GPU: eight sources, the AWQ and Marlin kernels
among them, several minutes of compilation inside the first forward (and an error where no CUDA toolkit is
installed). An int4 weight unpacks on the GPU when it moves there (quanto's ``.to("cuda")`` repacks it for the
device; the streaming executor keeps quantized layers in that device form) and in the dequantizing matmul of
weights outside the TinyGemm and AWQ layouts. On the first GPU run of the int4 benchmark (issue #32) the forward
did not finish within its 60 s for this reason.

The patch registers quanto's own portable kernel (the op's ``default`` implementation: shifts and masks on
``uint8``, the same integers) as the CUDA kernel instead. quanto's other CUDA kernels (AWQ fp16 matmuls, Marlin
fp8) are untouched and still build on their own first use. ``apply()`` is idempotent, ``revert()`` gives the op
back its previous CUDA kernel, and ``apply()`` refuses an optimum-quanto outside :data:`QUANTO`. A kernel registration
is not an attribute, so this is the one patch that does not go through :class:`~.patch.Patch`; it keeps its verbs.
"""

from __future__ import annotations

import inspect

import torch

from .patch import Release

# The release line both quanto patches were read against.
QUANTO = Release("optimum.quanto", ">=0.2,<0.3", "optimum-quanto==0.2.7")
_PORTABLE = torch._C.DispatchKeySet(torch._C.DispatchKey.CompositeExplicitAutograd)
_registration: torch.library.Library | None = None


def apply() -> None:
    """Makes ``quanto::unpack`` on CUDA tensors run quanto's portable kernel (idempotent).

    Raises:
        RuntimeError: optimum-quanto is of another release line.
        ModuleNotFoundError: optimum-quanto is not installed.
    """
    global _registration
    if _registration is not None:
        return
    QUANTO.check(
        user="specexec_hf.patches.quanto_unpack (its quanto::unpack op and portable kernel)",
        otherwise="let quanto build its CUDA extension (nvcc and ninja; minutes on first use)",
    )
    import optimum.quanto  # noqa: F401 (defines the op and its portable kernel)

    registration = torch.library.Library("quanto", "IMPL")
    # torch releases that refuse a second Python kernel for one key unless told take `allow_override`.
    override = {"allow_override": True} if "allow_override" in inspect.signature(registration.impl).parameters else {}
    registration.impl("unpack", _portable_unpack, "CUDA", **override)
    _registration = registration


def _portable_unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """quanto's ``default`` (CompositeExplicitAutograd) kernel of ``quanto::unpack``, which runs on any device."""
    return torch.ops.quanto.unpack.default.redispatch(_PORTABLE, packed, bits)


def revert() -> None:
    """Gives ``quanto::unpack`` back the CUDA kernel it had before :func:`apply` (nothing if not applied)."""
    global _registration
    if _registration is not None:
        _registration._destroy()
        _registration = None


def is_applied() -> bool:
    return _registration is not None
