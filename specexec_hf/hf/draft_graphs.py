"""The draft's forward over a preallocated KV cache and a padded feed, replayed as a CUDA graph per shape.

A small draft's forward on a GPU is shorter than the host's work to launch its kernels: on an H200 a
Llama-3.2-1B-shaped draft's 16-node tree feed took 16.2 ms launched eagerly and 2.93 ms replayed as a CUDA graph
(the same logits). A graph replays fixed shapes at fixed addresses, so :class:`StaticDraftCache` gives every
forward of a feed-width bucket and a cache-capacity bucket identical shapes and buffers:

- the keys and values of each layer live in ``[1, kv_heads, capacity, head_dim]`` buffers allocated once per
  capacity (a power of two, grown by copying when a history outgrows it, up to ``max_capacity``);
- a feed of ``n`` tokens is padded to a width ``W``, the next power of two: its tokens, positions, the cache slots its
  keys go to and its ``[W, capacity]`` attention mask are written in place into that width's buffers. Padding rows
  see only their own slot, past the cache's length, which the next forward overwrites; the real rows see what the
  feed's pattern shows them and nothing past the cache's length;
- on CUDA each (width, capacity, scored columns) is captured once as a ``torch.cuda.CUDAGraph`` (after warm-up
  forwards on a side stream, as torch's documentation asks) and replayed; elsewhere the same forward runs eagerly
  over the same buffers, which is how the CPU tests check it. Feeds wider than :data:`MAX_GRAPHED_WIDTH` (a prompt's
  prefill) run eagerly, unpadded, over the same cache.

No step reads the device: the cache length, the widths and the capacity are host counts. A drafter that is done
hands its cache, buffers and graphs, to the draft's next drafter (:func:`reused_static_cache`): ``generate()`` builds
a drafter per call.

transformers' ``StaticCache`` does not do this job: in transformers 5.19 its layers write each forward's keys after
their own running counter (4.x wrote them at the ``cache_position`` the model computed), so where a write goes is
not the caller's to say and has changed between releases, and it has no in-place cut that keeps the accepted tree
nodes' keys. :class:`StaticDraftCache` is a :class:`~transformers.Cache` whose ``update`` writes at the
slots it was given, which every supported family calls the same way.

The static path holds the full-attention caches of the families :data:`~.forward.VERIFIED_MODEL_TYPES` names, under
SDPA or eager attention (:func:`static_path_refusal` says why another draft cannot take it).
"""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass
from typing import Any, Literal

import torch
from transformers import Cache, PreTrainedModel

from .attention_spans import attention_spans
from .compat import execution_device
from .forward import VERIFIED_MODEL_TYPES, Feed, attention_mask_for

DraftGraphs = Literal["auto", "on", "off"]
"""Whether the draft runs over a static cache, replayed as CUDA graphs on a GPU: ``"auto"`` (on for a CUDA draft
whose trees grow in fixed-shape rounds, ``tree_search="rounds"``, when the static path holds its cache; off
otherwise), ``"on"`` (always; eagerly on a CPU; an error for a draft the path cannot hold) or ``"off"``."""
DRAFT_GRAPHS_MODES = ("auto", "on", "off")
FIRST_CAPACITY = 256
"""The smallest cache capacity allocated, in tokens."""
DEFAULT_MAX_CAPACITY = 1 << 15
"""The largest cache capacity, in tokens, of a draft whose config names no ``max_position_embeddings``: 1 GiB for a
Llama-3.2-1B-shaped draft in bfloat16."""
MAX_GRAPHED_WIDTH = 256
"""The widest feed padded and graphed; a wider one (a prompt's prefill) runs eagerly, once per prompt."""
KEPT_PER_DRAFT = 8
"""The most finished drafters' static caches kept per draft for reuse (a server's burst of requests drops the rest)."""
WARMUP_FORWARDS = 2
"""Forwards run on a side stream before a shape is captured (lazy initialisations, cuBLAS workspaces)."""
GRAPHED_ATTENTION = ("sdpa", "eager")


def static_path_refusal(model: PreTrainedModel) -> str | None:
    """Why :class:`StaticDraftCache` cannot hold ``model``'s cache, or ``None`` when it can.

    Args:
        model: The draft.
    """
    config = model.config
    if config.model_type not in VERIFIED_MODEL_TYPES:
        return (f"its family ({config.model_type!r}) is not one whose forward the static cache was checked with "
                f"({', '.join(sorted(VERIFIED_MODEL_TYPES))})")
    if config._attn_implementation not in GRAPHED_ATTENTION:
        return (f"its attention implementation ({config._attn_implementation!r}) is not one whose 4-D mask the static "
                f"path writes ({', '.join(GRAPHED_ATTENTION)})")
    partial = sorted(kind for kind, span in attention_spans(config).items() if not span.is_full)
    if partial:
        return f"it has {', '.join(partial)} layers, whose windows the static cache does not apply"
    if any(hasattr(module, "_hf_hook") for module in model.modules()):
        return "hooks move its weights in around its forward (offloading), which a captured graph would not replay"
    return None


def uses_draft_graphs(mode: DraftGraphs, model: PreTrainedModel, rounds_search: bool) -> bool:
    """Whether a drafter with ``draft_graphs=mode`` runs ``model`` over a :class:`StaticDraftCache`.

    Args:
        mode: See :data:`DraftGraphs`.
        model: The draft.
        rounds_search: Whether the trees grow in fixed-shape rounds (``"auto"`` turns the path on only then: other
            searches feed widths that vary from forward to forward).

    Raises:
        ValueError: For an unknown mode, or ``"on"`` with a draft the static path cannot hold.
    """
    if mode not in DRAFT_GRAPHS_MODES:
        raise ValueError(f"draft_graphs must be one of {', '.join(map(repr, DRAFT_GRAPHS_MODES))}, got {mode!r}.")
    if mode == "off":
        return False
    refusal = static_path_refusal(model)
    if mode == "on" and refusal is not None:
        raise ValueError(f"draft_graphs='on' needs a static draft cache, which this draft cannot use: {refusal}. "
                         "Pass draft_graphs='off' (or 'auto', which falls back to the dynamic cache).")
    return refusal is None and (mode == "on" or (execution_device(model).type == "cuda" and rounds_search))


def width_bucket(count: int) -> int:
    """The padded width of a feed of ``count`` tokens: the next power of two."""
    return 1 << max(count - 1, 0).bit_length()


@dataclass
class _ShapeBuffers:
    """The inputs of every forward of one (width, capacity), written in place: ``tokens`` and ``positions``
    ``[1, width]``, ``slots`` ``[width]`` (where the keys go) and ``mask`` ``[1, 1, width, capacity]``."""

    tokens: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    mask: torch.Tensor


class StaticDraftCache(Cache):
    """A draft's KV cache preallocated per capacity bucket, and the draft's forward over it (see the module).

    It holds one sequence: the first :attr:`length` slots are the cache, in the order the tokens were fed, as a
    ``DynamicCache`` would hold them.

    Args:
        model: The draft; its config sizes the buffers, its execution device holds them.
        max_capacity: The most tokens the cache may hold (the history and one tree's fed nodes, plus a feed's
            padding); a forward that needs more raises before allocating. ``None``: the draft's
            ``max_position_embeddings`` and the widest padded feed, so any history the draft can take fits (only the
            capacity buckets a history reaches are allocated).
        capture: Replay each shape as a CUDA graph; ``None``: when the draft runs on CUDA.
    """

    def __init__(self, model: PreTrainedModel, max_capacity: int | None = None, capture: bool | None = None):
        super().__init__(layers=[])
        refusal = static_path_refusal(model)
        if refusal is not None:
            raise ValueError(f"The static draft cache cannot hold this draft's cache: {refusal}. Run the draft over "
                             "its dynamic cache (draft_graphs='off').")
        # Weakly: a cache kept for reuse (see reused_static_cache) must not keep its draft alive.
        self._model = weakref.ref(model)
        self.device = execution_device(model)
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError(f"CUDA graphs capture CUDA work; this draft runs on {self.device}: pass capture=False.")
        config = model.config.get_text_config(decoder=True)
        if max_capacity is None:
            positions = getattr(config, "max_position_embeddings", None)
            max_capacity = DEFAULT_MAX_CAPACITY if positions is None else positions + MAX_GRAPHED_WIDTH
        self.max_capacity = max_capacity
        self.length = 0
        self.capacity = 0
        self._layers = config.num_hidden_layers
        self._kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self._head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._slots = torch.empty(0, dtype=torch.long, device=self.device)  # the running forward's write slots
        self._buffers: dict[int, _ShapeBuffers] = {}  # per width, at the current capacity
        # Per (width, scored columns), at the current capacity: the graph and its output.
        self._graphs: dict[tuple[int, bool], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool: Any = None

    @property
    def model(self) -> PreTrainedModel:
        """The draft."""
        model = self._model()
        if model is None:
            raise ReferenceError("The draft of this static cache is gone.")
        return model

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """How many tokens the cache holds (a host count)."""
        return self.length

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Writes a forward's keys and values at the slots its buffers name; returns the layer's whole buffers (the
        mask hides every slot the forward may not see)."""
        keys, values = self._keys[layer_idx], self._values[layer_idx]
        keys.index_copy_(2, self._slots, key_states)
        values.index_copy_(2, self._slots, value_states)
        return keys, values

    def compact(self, keep_prefix: int, slots: torch.Tensor) -> None:
        """Keeps slots ``[0, keep_prefix)`` followed by ``slots`` (ascending, ``>= keep_prefix``), in place, as
        :func:`~.kv.compact_cache` does for a dynamic cache."""
        kept = keep_prefix + slots.numel()
        if slots.numel():
            slots = slots.to(self.device)
            for buffer in self._keys + self._values:
                buffer[:, :, keep_prefix:kept] = buffer[:, :, slots]
        self.length = kept

    def logits(self, feed: Feed, scored_columns: bool = False) -> torch.Tensor:
        """The draft's forward over ``feed`` (whose ``cache`` is this one); the float32 logits ``[num_logits,
        vocab]`` of its last ``num_logits`` tokens. The fed tokens' keys and values join the cache.

        Args:
            feed: The tokens, their positions and pattern over this cache.
            scored_columns: Whether the draft's head returns part of the vocabulary in this call
                (:func:`.draft_cache.scored_columns`): a graph replays the head's output as it was captured.
        """
        count = feed.tokens.numel()
        graphed = count <= MAX_GRAPHED_WIDTH
        self._reserve(self.length + (width_bucket(count) if graphed else count))
        if not graphed:
            keep = torch.arange(count - feed.num_logits, count, device=self.device)
            logits = self._forward(self._write(feed, count, self._new_buffers(count)), keep)
        else:
            width = width_bucket(count)
            if width not in self._buffers:
                self._buffers[width] = self._new_buffers(width)
            buffers = self._write(feed, width, self._buffers[width])
            output = self._replay(buffers, scored_columns) if self.capture else self._forward(buffers)
            # A copy: the next replay overwrites the graph's output.
            logits = output[count - feed.num_logits : count].clone()
        self.length += count
        return logits

    def _reserve(self, needed: int) -> None:
        """Grows the buffers to the capacity bucket holding ``needed`` slots, copying the cache; raises before any
        allocation when that is past :attr:`max_capacity`."""
        if needed <= self.capacity:
            return
        if needed > self.max_capacity:
            raise ValueError(
                f"The draft's static cache would need {needed} slots (a history of {self.length} tokens and a feed "
                f"padded to {needed - self.length}), more than its max_capacity of {self.max_capacity}: run the draft "
                "over its dynamic cache (draft_graphs='off') or allow a larger max_capacity."
            )
        capacity = min(max(FIRST_CAPACITY, width_bucket(needed)), self.max_capacity)
        dtype = self.model.dtype
        shape = (1, self._kv_heads, capacity, self._head_dim)
        grown_keys = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self._layers)]
        grown_values = [torch.zeros(shape, dtype=dtype, device=self.device) for _ in range(self._layers)]
        for old, new in zip(self._keys + self._values, grown_keys + grown_values):
            new[:, :, : self.length] = old[:, :, : self.length]
        self._keys, self._values, self.capacity = grown_keys, grown_values, capacity
        self._buffers.clear()  # graphs and buffers of the old capacity point at freed memory
        self._graphs.clear()

    def _new_buffers(self, width: int) -> _ShapeBuffers:
        """Input buffers for feeds of ``width`` tokens at the current capacity."""
        mask_dtype = torch.bool if self.model.config._attn_implementation == "sdpa" else self.model.dtype
        return _ShapeBuffers(
            torch.zeros(1, width, dtype=torch.long, device=self.device),
            torch.zeros(1, width, dtype=torch.long, device=self.device),
            torch.zeros(width, dtype=torch.long, device=self.device),
            torch.zeros(1, 1, width, self.capacity, dtype=mask_dtype, device=self.device),
        )

    def _write(self, feed: Feed, width: int, buffers: _ShapeBuffers) -> _ShapeBuffers:
        """Writes ``feed``, padded to ``width``, into ``buffers`` in place."""
        count, length = feed.tokens.numel(), self.length
        pattern = torch.zeros(width, self.capacity, dtype=torch.bool, device=self.device)
        pattern[:count, : length + count] = feed.visibility()
        # A padding row sees its own slot: a row that sees nothing is NaN under some attention kernels, and a NaN
        # value in a slot no real row sees would still reach them (0 * NaN) once written there. A fill of a diagonal
        # view: indexing by a tensor of rows may synchronise.
        pattern[:, length : length + width].diagonal()[count:] = True
        buffers.mask.copy_(attention_mask_for(self.model, pattern[None]))
        buffers.tokens.zero_()
        buffers.tokens[0, :count] = feed.tokens
        buffers.positions.zero_()
        buffers.positions[0, :count] = feed.positions
        torch.arange(length, length + width, out=buffers.slots)
        return buffers

    def _forward(self, buffers: _ShapeBuffers, keep: torch.Tensor | int = 0) -> torch.Tensor:
        """The draft's forward over ``buffers``: float32 logits of the rows ``keep`` names (0: every row)."""
        self._slots = buffers.slots
        with torch.no_grad():
            out = self.model(
                input_ids=buffers.tokens, position_ids=buffers.positions, past_key_values=self,
                attention_mask=buffers.mask, use_cache=True, logits_to_keep=keep,
            )
        logits: torch.Tensor = out.logits[0].float()
        return logits

    def _replay(self, buffers: _ShapeBuffers, scored_columns: bool) -> torch.Tensor:
        """Replays the graph of ``buffers``' shape, capturing it first; returns its output buffer."""
        key = (buffers.tokens.shape[1], scored_columns)
        if key not in self._graphs:
            # The warm-up forwards write the same keys to the same slots as the replay will: nothing else changes.
            side = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP_FORWARDS):
                    self._forward(buffers)
            torch.cuda.current_stream(self.device).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            # Thread-local: an offload executor's threads may launch copies while the draft is captured.
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                output = self._forward(buffers)
            self._graphs[key] = (graph, output)
        graph, output = self._graphs[key]
        graph.replay()  # reads the buffers and writes the slots it was captured with
        return output


# Per draft, the static caches of drafters that are done, kept with their buffers and captured graphs: generate()
# builds a drafter per call, and capturing every shape again per call would cost more than short calls gain.
_RELEASED: weakref.WeakKeyDictionary[PreTrainedModel, list[StaticDraftCache]] = weakref.WeakKeyDictionary()
_RELEASED_LOCK = threading.Lock()


def reused_static_cache(model: PreTrainedModel) -> StaticDraftCache:
    """An empty :class:`StaticDraftCache` for ``model``: one a finished drafter released (buffers and graphs kept),
    else a new one. Hand it back with :func:`release_static_cache` once done with it."""
    with _RELEASED_LOCK:
        released = _RELEASED.get(model)
        cache = released.pop() if released else None
    if cache is None:
        return StaticDraftCache(model)
    cache.length = 0
    cache.capture = cache.device.type == "cuda"
    return cache


def release_static_cache(cache: StaticDraftCache) -> None:
    """Keeps ``cache`` for the next :func:`reused_static_cache` of its draft (while the draft lives, and up to
    :data:`KEPT_PER_DRAFT` of them)."""
    model = cache._model()
    if model is not None:
        with _RELEASED_LOCK:
            released = _RELEASED.setdefault(model, [])
            if len(released) < KEPT_PER_DRAFT:
                released.append(cache)
