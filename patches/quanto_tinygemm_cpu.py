"""optimum-quanto unpacks int4 weights packed for torch's CPU kernel without a product over an identity matrix.

quanto keeps a bfloat16 model's int4 weights (128-wide groups) in torch's "tinygemm" layout, which is device specific:
moving such a weight from the CPU to a GPU unpacks it on the CPU and packs it again for the GPU. quanto unpacks by
running torch's int4 CPU matmul on an identity matrix, ``in_features**2 * out_features`` multiply-adds per weight:
on the third GPU run of issue #32 the streaming executor's move of four Llama-3-70B int4 layers to an H200 spent its
whole minute inside that product (about a minute for one Llama-3-8B-sized layer on that machine's CPU, and it grows
with the square of the input width).

The layout is a fixed permutation of the nibbles, set by torch's own packer (and by the CPU's vector width, which
that packer chooses at run time). The patch learns it from that packer, once per weight shape: it packs the digits
of each element's position, base 16, and reads back where each position's nibble went. Unpacking is then one
scatter, the same integers as quanto's (tests/test_quanto_tinygemm_cpu_patch.py compares them). A learnt layout
takes 4 bytes per weight element (0.94 GB for Llama-3-70B's 28672 x 8192 projections; learning it briefly takes
about four times that), and the last four shapes are kept. GPU-packed weights keep quanto's own unpack (a product on
the GPU, cheap there).

``apply()`` is idempotent, ``revert()`` restores quanto's method and drops the learnt layouts, and ``apply()``
refuses an optimum-quanto outside :data:`~.quanto_unpack.QUANTO` or one whose ``unpack`` takes other parameters.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch

from .patch import Patch
from .quanto_unpack import QUANTO

__all__ = ["apply", "is_applied", "revert", "unpack_cpu_int4pack"]

INNER_K_TILES = 2  # what quanto's TinyGemmPackedTensor.pack passes to torch's packer


@functools.lru_cache(maxsize=4)  # a decoder layer's linear weights come in at most four shapes
def _nibble_sources(rows: int, columns: int) -> torch.Tensor:
    """``[rows * columns]`` int32: the flat ``(row, column)`` position whose nibble each packed nibble holds, in
    the order (packed byte, low nibble first) of torch's CPU int4 layout for a ``[rows, columns]`` weight."""
    positions = torch.arange(rows * columns, dtype=torch.int32).view(rows, columns)
    low = torch.zeros(rows, columns // 2, dtype=torch.int32)
    high = torch.zeros_like(low)
    shift = 0
    while (rows * columns - 1) >> shift:
        packed = torch._convert_weight_to_int4pack_for_cpu((positions >> shift) & 15, innerKTiles=INNER_K_TILES)
        low |= (packed & 15).to(torch.int32) << shift
        high |= (packed >> 4).to(torch.int32) << shift
        shift += 4
    return torch.stack([low, high], -1).flatten()


def unpack_cpu_int4pack(packed: torch.Tensor, rows: int, columns: int) -> torch.Tensor:
    """The ``[rows, columns]`` uint8 values (0-15) that torch's CPU packer turned into ``packed``.

    Args:
        packed: ``torch._convert_weight_to_int4pack_for_cpu``'s output for a ``[rows, columns]`` weight (on the CPU).
        rows: The weight's output features.
        columns: Its input features.
    """
    nibbles = torch.stack([packed & 15, packed >> 4], -1).flatten()
    if nibbles.numel() != rows * columns:
        raise ValueError(
            f"{list(packed.shape)} packed bytes cannot hold a [{rows}, {columns}] int4 weight in torch's CPU layout "
            "(two values a byte): pass the shape the weight was packed from."
        )
    values = torch.empty(rows * columns, dtype=torch.uint8)
    values[_nibble_sources(rows, columns)] = nibbles
    return values.view(rows, columns)


def _unpacking_cpu_by_layout(original: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """quanto's ``TinyGemmPackedTensor.unpack``, by the learnt layout for CPU-packed weights."""

    def unpack(self) -> torch.Tensor:
        if self._data.device.type != "cpu":
            return original(self)
        return unpack_cpu_int4pack(self._data, *self.size())

    return unpack


_WHY = "specexec_hf.patches.quanto_tinygemm_cpu (TinyGemmPackedTensor.unpack)"
_OTHERWISE = (
    "leave the patch off (quanto's own unpack: a product over an identity matrix, minutes per large int4 weight moved "
    "off the CPU)"
)
_PATCH: Patch | None = None  # built on first use: quanto is an optional dependency


def _patch() -> Patch:
    global _PATCH
    if _PATCH is None:
        from optimum.quanto.tensor.weights.tinygemm.packed import TinyGemmPackedTensor

        _PATCH = Patch(TinyGemmPackedTensor, "unpack", ("self",), _unpacking_cpu_by_layout, QUANTO, _WHY, _OTHERWISE)
    return _PATCH


def apply() -> None:
    """Makes quanto unpack CPU-packed int4 weights by the learnt layout (idempotent).

    Raises:
        UnsupportedRelease: optimum-quanto is of another release line, or its unpack takes other parameters.
        ModuleNotFoundError: optimum-quanto is not installed.
    """
    # The release line first: another line may not have the module _patch() imports.
    QUANTO.check(user=_WHY, otherwise=_OTHERWISE)
    _patch().apply()


def revert() -> None:
    """Gives quanto back its own unpack and forgets the learnt layouts (nothing if not applied)."""
    if _PATCH is not None and _PATCH.applied:
        _PATCH.revert()
        _nibble_sources.cache_clear()


def is_applied() -> bool:
    return _PATCH is not None and _PATCH.applied
