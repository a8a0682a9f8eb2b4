"""SDPA tree attention over vLLM's paged KV cache: what the tree verifier (:mod:`.tree_verifier`) recomputes for
the tree rows of a step, and the probe that checks the CPU attention backend stores KV as these functions read it.

Pure torch over the backend's cache tensors, except :func:`probe_kv_layout`, which writes with vLLM's own cache writer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def tree_rows_mask(ancestors: torch.Tensor, prefix_length: int) -> torch.Tensor:
    """``[N - 1, prefix_length + N]`` bool: what each non-root node sees (the prefix, its ancestors, itself).

    Args:
        ancestors: ``[N, N]`` from :meth:`TokenTree.ancestor_mask`; node 0 is the root.
        prefix_length: Committed tokens before the root.
    """
    rows = ancestors.shape[0] - 1
    prefix = torch.ones(rows, prefix_length, dtype=torch.bool, device=ancestors.device)
    return torch.cat([prefix, ancestors[1:]], dim=1)


def gather_paged_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, block_ids: torch.Tensor, length: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The first ``length`` positions of keys and values of one or several requests, as ``[..., kv_heads, length,
    head_size]`` each.

    The CPU backend stores each block's keys transposed (``[kv_heads, head_size, block_size]``, what its
    vectorised kernel reads) and its values as ``[kv_heads, block_size, head_size]``; :func:`probe_kv_layout`
    checks that against the backend's own cache writer before any tree is verified.

    Args:
        key_cache: ``[num_blocks, kv_heads, block_size, head_size]`` key half of a CPU backend cache.
        value_cache: The value half, same shape.
        block_ids: ``[..., blocks]`` block table rows, each with at least ``ceil(length / block_size)`` entries
            (a request shorter than ``length`` reads whatever its later entries name: mask those positions out).
        length: Positions to read.
    """
    num_blocks, kv_heads, block_size, head_size = key_cache.shape
    used = block_ids[..., : -(-length // block_size)].long()
    batch = used.shape[:-1]
    keys = key_cache.reshape(num_blocks, kv_heads, head_size, block_size)[used]  # [..., b, H, D, bs]
    keys = keys.transpose(-4, -3).transpose(-1, -2).reshape(*batch, kv_heads, -1, head_size)[..., :length, :]
    values = value_cache[used].transpose(-4, -3).reshape(*batch, kv_heads, -1, head_size)[..., :length, :]
    return keys, values


def tree_attention(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of tree rows over gathered KV under an explicit mask; returns ``[..., rows, heads, head_size]``.

    Args:
        query: ``[..., rows, heads, head_size]`` (rotary embedding applied); leading dimensions are requests.
        keys: ``[..., kv_heads, length, head_size]``; ``heads`` is a multiple of ``kv_heads`` (grouped queries).
        values: Same shape as ``keys``.
        visible: ``[..., rows, length]`` bool, True where a row may attend; every row must see some key.
        scale: Softmax scale.
    """
    groups = query.shape[-2] // keys.shape[-3]
    keys = keys.repeat_interleave(groups, dim=-3).to(query.dtype)
    values = values.repeat_interleave(groups, dim=-3).to(query.dtype)
    out = F.scaled_dot_product_attention(
        query.transpose(-3, -2), keys, values, attn_mask=visible.unsqueeze(-3), scale=scale
    )
    return out.transpose(-3, -2)


@dataclass
class PaddedTreeRows:
    """The tree rows of all of a step's tree requests, padded into one batch of attention (built once per step and
    read by every layer).

    Args:
        blocks: ``[R, blocks]`` each request's block table row, cut to the blocks the longest request reads.
        length: Key positions read per request (the longest request's prefix plus nodes).
        query_rows: ``[R, rows]`` flattened-batch rows of each request's non-root nodes; padding repeats a real row.
        visible: ``[R, rows, length]`` each row's mask; padding rows see the first key only.
        kept: ``[real rows]`` indices into the ``R * rows`` padded rows of the real ones, request by request.
        output_rows: ``[real rows]`` the flattened-batch rows they are written to (``query_rows`` without padding).
        beyond: ``[R, 1, length, 1]`` True at the positions past each request's own (whatever its blocks hold
            there is zeroed: a masked key still multiplies its value by 0, and 0 * nan is nan); ``None`` when every
            request reads all ``length``.
    """

    blocks: torch.Tensor
    length: int
    query_rows: torch.Tensor
    visible: torch.Tensor
    kept: torch.Tensor
    output_rows: torch.Tensor
    beyond: torch.Tensor | None


def pad_tree_rows(
    starts: list[int], visible: list[torch.Tensor], block_table: torch.Tensor, block_size: int
) -> PaddedTreeRows:
    """Pads the tree rows of ``R`` requests into one attention batch.

    Args:
        starts: Each request's root row in the flattened batch; its non-root nodes follow it.
        visible: Each request's ``[N - 1, prefix + N]`` mask (:func:`tree_rows_mask`).
        block_table: ``[R, max_blocks]`` the requests' block table rows.
        block_size: Positions per KV block.
    """
    device = block_table.device
    rows = max(mask.shape[0] for mask in visible)
    length = max(mask.shape[1] for mask in visible)
    padded = torch.zeros(len(visible), rows, length, dtype=torch.bool, device=device)
    padded[:, :, 0] = True
    query_rows = torch.empty(len(visible), rows, dtype=torch.long, device=device)
    kept, output_rows = [], []
    for index, (start, mask) in enumerate(zip(starts, visible)):
        count, seen = mask.shape
        padded[index, :count, :seen] = mask
        own = torch.arange(start + 1, start + 1 + count, device=device)
        query_rows[index] = own[-1]
        query_rows[index, :count] = own
        kept.append(torch.arange(index * rows, index * rows + count, device=device))
        output_rows.append(own)
    blocks = block_table[:, : -(-length // block_size)]
    own_lengths = torch.tensor([mask.shape[1] for mask in visible], device=device)
    beyond = None
    if bool((own_lengths < length).any()):
        beyond = (torch.arange(length, device=device) >= own_lengths[:, None])[:, None, :, None]
    return PaddedTreeRows(blocks, length, query_rows, padded, torch.cat(kept), torch.cat(output_rows), beyond)


def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The key and value halves of one CPU attention layer's cache, each ``[num_blocks, kv_heads, block_size,
    head_size]`` (views).

    Args:
        kv_cache: The layer's cache as the backend's forward receives it, ``[num_blocks, kv_heads, block_size, ...]``
            with each block's keys then values.
    """
    num_blocks, kv_heads, block_size, _ = kv_cache.shape
    return kv_cache.view(num_blocks, kv_heads, 2 * block_size, -1).chunk(2, dim=2)


def read_paged_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, slots: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys and values stored at ``slots`` (``block * block_size + offset``), ``[slots, kv_heads, head_size]``
    each: what :func:`gather_paged_kv` reads, slot by slot.

    Args:
        key_cache: ``[num_blocks, kv_heads, block_size, head_size]`` key half of a CPU backend cache.
        value_cache: The value half, same shape.
        slots: ``[n]`` cache slots.
    """
    num_blocks, kv_heads, block_size, head_size = key_cache.shape
    blocks, offsets = slots // block_size, slots % block_size
    keys = key_cache.reshape(num_blocks, kv_heads, head_size, block_size)[blocks, :, :, offsets]
    return keys, value_cache[blocks, :, offsets, :]


def probe_kv_layout(isa: str, dtype: torch.dtype, block_size: int, head_size: int) -> None:
    """Writes random KV with the CPU backend's own cache writer and checks that :func:`gather_paged_kv` and
    :func:`read_paged_kv` read it back.

    Raises:
        RuntimeError: The backend stores this ISA / dtype / block size differently.
    """
    from vllm import _custom_ops as ops

    generator = torch.Generator().manual_seed(0)
    num_blocks, kv_heads, tokens = 3, 2, block_size + 3
    cache = torch.zeros(num_blocks, kv_heads, 2 * block_size, head_size, dtype=dtype)
    key_cache, value_cache = cache.chunk(2, dim=2)
    keys = torch.randn(tokens, kv_heads, head_size, generator=generator).to(dtype)
    values = torch.randn(tokens, kv_heads, head_size, generator=generator).to(dtype)
    block_ids = torch.tensor([2, 0, 1])
    positions = torch.arange(tokens)
    slots = block_ids[positions // block_size] * block_size + positions % block_size
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
    read_keys, read_values = gather_paged_kv(key_cache, value_cache, block_ids, tokens)
    slot_keys, slot_values = read_paged_kv(key_cache, value_cache, slots)
    if not (
        torch.equal(read_keys, keys.transpose(0, 1))
        and torch.equal(read_values, values.transpose(0, 1))
        and torch.equal(slot_keys, keys)
        and torch.equal(slot_values, values)
    ):
        raise RuntimeError(
            f"vLLM's CPU attention backend stores KV differently for ISA {isa!r}, {dtype}, block size {block_size}, "
            f"head size {head_size} than specexec_hf.vllm.tree_attention reads it; tree verification cannot run here "
            "(set tree_verification=false)."
        )
