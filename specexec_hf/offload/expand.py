"""Quantized linear weights streamed packed and expanded into their compute dtype on the device, in place.

On a GPU, optimum-quanto's 4-bit products (TinyGemm, AWQ) are compute-bound past a few dozen tokens: over a tree
of a thousand nodes a streamed int4 Llama-3-70B layer cost 9x its one-token forward (issue 56), where a bfloat16
layer's forward stays flat. The device executor therefore streams a quantized weight's packed bytes as they are (a
quarter of bfloat16's over the link for int4), expands them into a dense weight in the compute dtype once they
have landed, and lets the module run a plain dense linear: the forward is the dense forward of the dequantized
model, whose cost over a tree is bfloat16's, and plain decoding and tree verification multiply the same numbers.

:class:`PackedWeight` is one such weight as streamed, :func:`packed_weight` takes it from a frozen quanto weight in
whichever layout quanto chose (its generic packing, or TinyGemm's, which is converted back once, on the host), and
:func:`expand_into` writes the dense weight into a preallocated buffer, bit-equal to quanto's ``dequantize()``.

Why a few torch kernels and not a fused Triton kernel: bit-equality with ``dequantize()`` needs quanto's two
roundings (the product by the scale, then the shift) and nothing else, which torch's elementwise kernels give on
every device, the CPU stand-in the executor is tested through included, without a compiler. The five passes move
about 7.5 bytes of device memory per weight element (a fused kernel: 2.5): for a Llama-3-70B layer (0.86 G
elements) about 6.5 GB, under 1.5 ms on an H200, against about 8 ms to stream its packed bytes over the link, and
the upload of the next layers runs meanwhile. A fused kernel is worth it only where the expansion, not the link, is
the floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

NIBBLE = 15
"""The mask of a 4-bit value in quanto's generic packing."""


@dataclass(frozen=True)
class PackedWeight:
    """One quantized linear weight as the device streams it: what :func:`expand_into` turns into the dense weight.

    The values are quantized in groups of ``group_size`` consecutive elements of a row; group ``i`` dequantizes as
    ``scale[i] * values - shift[i]`` (a float shift) or ``scale[i] * (values - shift[i])`` (an integer zero point),
    as quanto's ``dequantize()`` computes it, in ``scale``'s dtype.

    Args:
        packed: ``bits == 4``: ``uint8 [ceil(groups / 2), group_size]`` in quanto's generic packing, byte ``(i, j)``
            holding the ``j``-th value of group ``i`` in its low nibble and that of group ``i + ceil(groups / 2)``
            in its high one. ``bits == 8``: ``int8 [out_features, in_features]``, one group per row.
        scale: ``[groups, 1]`` in the compute dtype.
        shift: ``[groups, 1]``: in the compute dtype (subtracted after scaling) or ``uint8`` (a zero point,
            subtracted before); ``None`` for 8 bits.
        group_size: Values per group.
        shape: The dense weight's ``(out_features, in_features)``.
        bits: 4 or 8.
    """

    packed: torch.Tensor
    scale: torch.Tensor
    shift: torch.Tensor | None
    group_size: int
    shape: tuple[int, int]
    bits: int

    @property
    def dtype(self) -> torch.dtype:
        """The compute dtype the weight expands into."""
        return self.scale.dtype

    @property
    def groups(self) -> int:
        return math.prod(self.shape) // self.group_size

    @property
    def scratch_bytes(self) -> int:
        """The ``uint8`` scratch :func:`expand_into` needs: a half's nibbles (none for 8 bits)."""
        return self.packed.numel() if self.bits == 4 else 0


def expandable(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a quantized linear weight :func:`packed_weight` takes: an optimum-quanto int4 weight
    (grouped along its rows, any layout) or int8 weight (one scale per row), both two-dimensional."""
    if type(weight) in (torch.Tensor, nn.Parameter):
        return False
    try:
        from optimum.quanto import WeightQBitsTensor, WeightQBytesTensor, qint4, qint8
    except ImportError:  # without quanto, no weight is one of its
        return False
    if weight.dim() != 2 or getattr(weight, "axis", None) != 0:
        return False
    if isinstance(weight, WeightQBitsTensor):
        return weight.qtype == qint4
    return type(weight) is WeightQBytesTensor and weight.qtype == qint8 and weight.activation_qtype is None


def streamed_form(weight: torch.Tensor) -> torch.Tensor:
    """``weight`` (see :func:`expandable`) in quanto's kernel-agnostic layout, the one :class:`PackedWeight` reads.

    A generic weight is returned as it is; a weight in a kernel's layout (TinyGemm, AWQ) is converted back by
    quanto (``weight_qbits_tensor()``: the same numbers its ``dequantize()`` computes with). For TinyGemm on the CPU
    that unpacks through a product over an identity matrix unless ``specexec_hf.patches.quanto_tinygemm_cpu`` is
    applied, as moving such a weight to a GPU always did.
    """
    from optimum.quanto import WeightQBitsTensor

    if isinstance(weight, WeightQBitsTensor) and type(weight) is not WeightQBitsTensor:
        return weight.weight_qbits_tensor()
    return weight


def packed_weight(weight: torch.Tensor) -> PackedWeight:
    """The :class:`PackedWeight` of a frozen quanto weight; for one in the generic layout (:func:`streamed_form`),
    views of its own inner tensors, so that a weight bound over a ring slot gives views of that slot.

    Raises:
        ValueError: ``weight`` is not one :func:`expandable` accepts.
    """
    if not expandable(weight):
        raise ValueError(
            f"A {type(weight).__name__} of shape {list(weight.shape)} is not a quanto int4 weight grouped along its "
            "rows nor an int8 weight with one scale per row (weight-only): only those expand into a dense weight; "
            "leave the module unexpanded (expand_quantized=False)."
        )
    generic = streamed_form(weight)
    out_features, in_features = generic.shape
    if generic.qtype.bits == 8:
        return PackedWeight(generic._data, generic._scale, None, in_features, (out_features, in_features), 8)
    group_size = generic._group_size or in_features  # quanto's None: one group per row
    return PackedWeight(
        generic._data._data, generic._scale, generic._shift, group_size, (out_features, in_features), 4
    )


def expand_into(weight: PackedWeight, dense: torch.Tensor, scratch: torch.Tensor) -> None:
    """Writes ``weight``'s dense values into ``dense`` (``weight.shape``, ``weight.dtype``, contiguous), bit-equal
    to quanto's ``dequantize()``, on ``dense``'s device and queue, in place: no allocation beyond a ``[groups, 1]``
    temporary for a zero point.

    Args:
        weight: The packed weight.
        dense: Where its dense values go.
        scratch: ``uint8``, at least ``weight.scratch_bytes`` of it, on the same device and queue (used in turn by
            consecutive expansions): the nibbles pass through it, as torch's CUDA bitwise kernels write only their
            inputs' integer dtype.

    Raises:
        ValueError: ``dense`` has another shape or dtype or is not contiguous, or ``scratch`` is too small.
    """
    if tuple(dense.shape) != weight.shape or dense.dtype != weight.dtype or not dense.is_contiguous():
        raise ValueError(
            f"The dense buffer is {list(dense.shape)} {dense.dtype} (contiguous: {dense.is_contiguous()}), but the "
            f"weight expands into a contiguous {list(weight.shape)} {weight.dtype} tensor."
        )
    if scratch.dtype != torch.uint8 or scratch.numel() < weight.scratch_bytes:
        raise ValueError(
            f"The scratch is {scratch.numel()} x {scratch.dtype}; the weight needs {weight.scratch_bytes} x uint8."
        )
    if weight.bits == 8:
        torch.mul(weight.packed, weight.scale, out=dense)  # quanto: scale * data, one rounding
        return
    grouped = dense.view(weight.groups, weight.group_size)
    low = weight.packed.shape[0]  # groups held in the low nibbles
    zero_point = None if weight.shift.dtype.is_floating_point else weight.shift.to(weight.dtype)
    halves = (
        (torch.bitwise_and, weight.packed, NIBBLE, slice(0, low)),
        (torch.bitwise_right_shift, weight.packed[: weight.groups - low], 4, slice(low, weight.groups)),
    )
    for extract, packed, operand, rows in halves:
        nibbles = scratch[: packed.numel()].view(packed.shape)
        extract(packed, operand, out=nibbles)
        if zero_point is None:  # quanto: scale * values, rounded (then minus the shift, rounded, below)
            torch.mul(nibbles, weight.scale[rows], out=grouped[rows])
        else:  # quanto: values - zero point, exact small integers (then times the scale, rounded once, below)
            torch.sub(nibbles, zero_point[rows], out=grouped[rows])
    if zero_point is None:
        grouped.sub_(weight.shift)
    else:
        grouped.mul_(weight.scale)
