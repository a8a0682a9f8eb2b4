"""Self-drafts: the target itself, weight-quantized to 4 or 8 bits, as the draft of a target with no small sibling.

A self-draft is a copy of the target whose linear layers hold int4 or int8 weights (optimum-quanto), so it shares
the tokenizer and the vocabulary by construction and agrees with the target far more often than a smaller
model would. It pays only where the quantized forward is much cheaper than the target's: a target offloaded to
host memory or disk, with the self-draft resident on the accelerator, is the case it is made for. On a CPU,
quanto's kernels dequantize the weights on every forward and the self-draft is slower than an in-memory target.

A layer self-draft is the target's own decoder layers, a subset of them, between its embedding and its final norm
and LM head: ``"self:exit:K"`` runs the first ``K`` layers (LayerSkip's early exit), ``"self:skip:10-20"`` runs all
but the named ones (S3D's skipped middle layers). It shares the target's modules, so it costs no memory beyond its
own KV cache, and when the target is offloaded its default layers are the ones resident in fast memory, so it
drafts without streaming a weight.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import os
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import PreTrainedModel

from ..hf.compat import execution_device, use_sdpa_attention
from ..hf.self_draft import register_draft_resolver

SELF_DRAFTS = {"self:int4": 4, "self:int8": 8}
"""The quantized self-drafts' names :func:`resolve_draft` accepts, with their weight bits."""
LAYER_SELF_DRAFTS = ("self:exit", "self:skip")
"""The layer self-drafts' name prefixes :func:`resolve_draft` accepts: ``"self:exit:K"``, ``"self:skip:<layers>"``, or
the bare prefix for the default layers (see :func:`default_layer_spec`)."""
SELF_DRAFT_ATTRIBUTE = "specexec_self_draft"
"""Attribute of a self-draft's ``config`` naming what it is (``"self:int4"``, ``"self:exit:15"``, ...)."""

_QUANTO_HINT = "pip install 'specexec-hf[quanto]' (or pip install optimum-quanto)"
# Per target, its self-drafts by name: built once, so their online acceptance maps carry over between calls.
_built: weakref.WeakKeyDictionary[PreTrainedModel, dict[str, PreTrainedModel]] = weakref.WeakKeyDictionary()


def self_draft(target: PreTrainedModel, bits: int = 4, device: torch.device | str | None = None) -> PreTrainedModel:
    """A draft made of ``target`` itself with its linear layers' weights quantized to ``bits`` (optimum-quanto).

    The target is left untouched: its weights are copied, then the copy is quantized and frozen (the float weights
    of its linear layers are dropped). Embeddings and norms stay in the target's dtype.

    Args:
        target: A causal LM with every weight in memory (build the self-draft before offloading the target).
        bits: 4 (``qint4``, a scale and shift per group of up to 128 inputs) or 8 (``qint8``, a scale per output row).
        device: Where the self-draft lives; default: the target's execution device.

    Raises:
        ValueError: ``bits`` is neither 4 nor 8, or the target's weights are not all in memory.
        ImportError: optimum-quanto is not installed.
    """
    if bits not in SELF_DRAFTS.values():
        raise ValueError(f"A self-draft quantizes to 4 or 8 bits, got bits={bits!r}.")
    offloaded = [name for name, parameter in target.named_parameters() if parameter.device.type == "meta"]
    if offloaded:
        raise ValueError(
            f"self_draft needs the target's weights in memory, but {len(offloaded)} are offloaded (e.g. "
            f"{offloaded[0]}): build the self-draft from the in-memory model first, "
            "`draft = self_draft(model, bits, device='cuda')`, then offload the model."
        )
    try:
        quanto = importlib.import_module("optimum.quanto")
    except ImportError as error:
        raise ImportError(f"Self-drafts quantize the target with optimum-quanto: {_QUANTO_HINT}") from error
    destination = torch.device(device) if device is not None else execution_device(target)
    draft = copy.deepcopy(target)
    quanto.quantize(draft, weights={4: quanto.qint4, 8: quanto.qint8}[bits])
    quanto.freeze(draft)
    setattr(draft.config, SELF_DRAFT_ATTRIBUTE, f"self:int{bits}")
    return use_sdpa_attention(draft.to(destination)).eval()


class _LayerCacheView:
    """The draft's KV cache as one shared decoder layer writes to it: the layer's attention names its index in the
    target, its keys and values land in the draft's layer ``index`` instead. The draft's cache thus holds its own
    layers only, numbered from 0 (models and :mod:`specexec_hf.hf.kv` read a cache's length from its layer 0)."""

    def __init__(self, cache: Any, index: int):
        self._cache, self._index = cache, index

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self._cache.update(key_states, value_states, self._index, *args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cache, name)


# How decoder layers name the KV cache they are given, across transformers' model families.
_CACHE_ARGUMENTS = ("past_key_values", "past_key_value", "layer_past")


class _SharedLayer(nn.Module):
    """One of the target's decoder layers, not copied, as the draft's layer ``index``.

    Attributes the model's forward reads from its layers (``attention_type``) are the target layer's.
    """

    def __init__(self, layer: nn.Module, index: int):
        super().__init__()
        self.layer, self.index = layer, index
        self._signature = inspect.signature(layer.forward)

    def forward(self, *args, **kwargs):
        # The cache may come by keyword or by position, depending on the family.
        bound = self._signature.bind_partial(*args, **kwargs)
        for name in _CACHE_ARGUMENTS:
            if bound.arguments.get(name) is not None:
                bound.arguments[name] = _LayerCacheView(bound.arguments[name], self.index)
        return self.layer(*bound.args, **bound.kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            layer = self.__dict__["_modules"].get("layer")
            if layer is None:
                raise
            return getattr(layer, name)


def _decoder_layers(target: PreTrainedModel) -> tuple[str, nn.ModuleList]:
    """The attribute of ``target.base_model`` holding its decoder layers, and those layers.

    Raises:
        ValueError: ``target`` is not a decoder-only causal LM with a list of decoder layers.
    """
    config = target.config
    base = target.base_model
    count = getattr(config, "num_hidden_layers", None)
    if not getattr(config, "is_encoder_decoder", False) and base is not target and count:
        for name, child in base.named_children():
            if isinstance(child, nn.ModuleList) and len(child) == count:
                return name, child
    raise ValueError(
        f"A layer self-draft ('self:exit:K', 'self:skip:...') runs some of a decoder-only causal LM's decoder layers, "
        f"but {type(target).__name__} has no list of num_hidden_layers decoder layers under its base model: pass a "
        "separate draft model, or 'self:int4' / 'self:int8'."
    )


def resident_layers(target: PreTrainedModel) -> list[bool]:
    """Per decoder layer of ``target``, whether its weights sit in fast memory, so that running it reads no weight.

    Fast memory is the execution device's (:func:`~specexec_hf.hf.compat.execution_device`): for a target
    dispatched by accelerate or the streaming executors, a layer is resident when its ``hf_device_map`` placement is
    an accelerator, or ``"cpu"`` where the target computes on the CPU; ``"disk"`` never is, nor is host memory under
    an accelerator (streamed to it on every forward). A layer the map does not place is resident unless its weights
    are offloaded (left on the meta device). A target in memory has every layer resident.

    Args:
        target: The target, in memory or offloaded.
    """
    _, layers = _decoder_layers(target)
    device_map = getattr(target, "hf_device_map", None) or {}
    computes_on_cpu = execution_device(target).type == "cpu"
    names = {id(module): name for name, module in target.named_modules()}

    def placement(name: str) -> Any:
        covering = [key for key in device_map if key == "" or name == key or name.startswith(key + ".")]
        return device_map[max(covering, key=len)] if covering else None

    def resident(layer: nn.Module) -> bool:
        where = placement(names[id(layer)])
        if where is None:
            return not any(parameter.is_meta for parameter in layer.parameters())
        return where != "disk" and (where != "cpu" or computes_on_cpu)

    return [resident(layer) for layer in layers]


def default_layer_spec(target: PreTrainedModel, kind: str) -> list[int]:
    """The layers ``"self:exit"`` / ``"self:skip"`` without a spec run.

    An offloaded target (some layer not :func:`resident_layers`): ``exit`` runs the longest run of resident layers
    from the first one, ``skip`` skips every layer that is not resident; either way the draft reads no layer weight
    (the embedding, final norm and LM head are the target's, wherever they are placed). A target in memory: ``exit``
    runs the first half of its layers, ``skip`` skips the middle half.

    Args:
        target: The target.
        kind: ``"exit"`` or ``"skip"``.

    Raises:
        ValueError: The target is offloaded and its first layer (``exit``) or every layer (``skip``) is not resident.
    """
    resident = resident_layers(target)
    count = len(resident)
    if all(resident):
        half = max(1, count // 2)
        kept = range(half) if kind == "exit" else [*range(half - half // 2), *range(count - half // 2, count)]
    elif kind == "exit":
        kept = range(resident.index(False))
    else:
        kept = [i for i, is_resident in enumerate(resident) if is_resident]
    if not kept:
        where = "starting from the first" if kind == "exit" else "at all"
        raise ValueError(
            f"'self:{kind}' runs the target's decoder layers held in fast memory, but none is ({where}; the target "
            f"has {count}): name the layers, e.g. 'self:exit:{max(1, count // 4)}' (they are then streamed for every "
            "draft forward, as for the target), or pass a separate draft model."
        )
    return list(kept)


def _parse_layers(spec: str, count: int, name: str) -> list[int]:
    """The decoder layers ``spec`` (``"3"``, ``"10-20"``, ``"0,2,5-7"``; ranges inclusive) names, sorted, unique."""
    layers: set[int] = set()
    for part in spec.split(","):
        low, dash, high = part.strip().partition("-")
        try:
            first, last = int(low), int(high if dash else low)
        except ValueError:
            raise ValueError(
                f"{name!r}: {part.strip()!r} is not a layer index or an inclusive range like '10-20'; write e.g. "
                f"'self:skip:{count // 4}-{count - count // 4 - 1}' or 'self:skip:1,3,5'."
            ) from None
        if not 0 <= first <= last < count:
            raise ValueError(
                f"{name!r}: layers {part.strip()!r} are outside 0-{count - 1} (the target has {count} decoder layers) "
                "or the range is reversed; name layers from 0 to num_hidden_layers - 1, ranges low-high."
            )
        layers.update(range(first, last + 1))
    return sorted(layers)


def _spans(layers: Sequence[int]) -> str:
    """``[0, 1, 2, 5, 7, 8]`` as ``"0-2,5,7-8"``."""
    spans: list[list[int]] = []
    for layer in layers:
        if spans and spans[-1][1] == layer - 1:
            spans[-1][1] = layer
        else:
            spans.append([layer, layer])
    return ",".join(str(low) if low == high else f"{low}-{high}" for low, high in spans)


def layer_spec(target: PreTrainedModel, name: str) -> tuple[str, list[int]]:
    """The layers a layer self-draft's name runs, and the name in its canonical form (``"self:exit:15"``,
    ``"self:skip:10-20"``), checked against ``target`` before anything is built.

    Args:
        target: The target.
        name: ``"self:exit"`` / ``"self:skip"`` (:func:`default_layer_spec`), ``"self:exit:K"`` (the first ``K``
            layers, ``1 <= K <= num_hidden_layers``) or ``"self:skip:<layers>"`` (all layers but those listed:
            indices and inclusive ranges, comma-separated, leaving at least one layer).

    Raises:
        ValueError: A malformed name, ``K`` out of range, an empty skip list or one that skips every layer, or a
            target without decoder layers.
    """
    _, kind, *spec = name.split(":", 2)
    count = len(_decoder_layers(target)[1])
    if not spec:
        layers = default_layer_spec(target, kind)
    elif kind == "exit":
        if not spec[0].strip().isdigit() or not 1 <= int(spec[0]) <= count:
            raise ValueError(
                f"{name!r}: K must be a whole number of layers from 1 to {count} (the target's decoder layers), e.g. "
                f"'self:exit:{count // 2}'."
            )
        layers = list(range(int(spec[0])))
    else:
        if not spec[0].strip():
            raise ValueError(
                f"{name!r} names no layer to skip: list them, e.g. 'self:skip:{count // 4}-{count - count // 4 - 1}' "
                "(inclusive ranges and indices, comma-separated), or write 'self:skip' for the default set."
            )
        skipped = _parse_layers(spec[0], count, name)
        layers = [i for i in range(count) if i not in skipped]
        if not layers:
            raise ValueError(
                f"{name!r} skips all {count} decoder layers: leave at least one, e.g. 'self:skip:1-{count - 1}'."
            )
    if kind == "exit":
        return f"self:exit:{len(layers)}", layers
    return f"self:skip:{_spans([i for i in range(count) if i not in layers])}", layers


class ExitAdapter(nn.Module):
    """A small trainable map a layer self-draft applies to its last hidden state, before the target's final norm
    and LM head: ``h + (h @ down) @ up``, of rank ``rank``. ``up`` starts at zero, so an untrained adapter changes
    nothing. LayerSkip trains the whole model for early exit; this tunes ``2 * hidden * rank`` weights only
    (``specexec-hf distill --stage exit``), for a target trained without it.

    Args:
        hidden: The target's hidden size.
        rank: The map's rank.
    """

    def __init__(self, hidden: int, rank: int = 64):
        super().__init__()
        if not 0 < rank <= hidden:
            raise ValueError(f"An exit adapter's rank must be in 1..{hidden} (the hidden size), got {rank}.")
        self.down = nn.Parameter(torch.randn(hidden, rank) / hidden**0.5)
        self.up = nn.Parameter(torch.zeros(rank, hidden))

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden + (hidden @ self.down.to(hidden.dtype)) @ self.up.to(hidden.dtype)


class _AdaptedNorm(nn.Module):
    """The target's final norm, applied after an :class:`ExitAdapter`."""

    def __init__(self, norm: nn.Module, adapter: ExitAdapter):
        super().__init__()
        self.norm, self.adapter = norm, adapter

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(self.adapter(hidden))


# How decoder-only families name their final norm, beside their decoder layers.
_FINAL_NORMS = ("norm", "final_layernorm", "ln_f", "final_norm")


def layer_self_draft(
    target: PreTrainedModel, layers: Sequence[int], name: str | None = None, exit_adapter: ExitAdapter | None = None
) -> PreTrainedModel:
    """A draft made of ``target``'s decoder ``layers``, in order, between its embedding and its final norm and LM head.

    The draft shares the target's modules (no weight is copied, nothing is allocated beyond an empty model shell) and
    keeps its own KV cache, whose layer ``j`` is ``layers[j]``'s. It runs those modules where they are: for an
    offloaded target, a layer that is not resident (:func:`resident_layers`) is streamed in for every draft forward
    exactly as for a target forward (a disk read where it is placed on disk), and so are the embedding, final norm
    and LM head if they are not resident; the default layers (:func:`default_layer_spec`) avoid that for the layers.
    Being the target's modules, they follow whatever is done to the draft: moving or converting the draft (``.to``,
    ``.half()``) or training it changes the target.

    Args:
        target: A decoder-only causal LM, in memory or offloaded.
        layers: Indices of the decoder layers to run, ascending, unique, at least one.
        name: What the draft is called (its ``config``'s :data:`SELF_DRAFT_ATTRIBUTE`); default from ``layers``.
        exit_adapter: Applied to the last layer's output before the final norm (a tuned exit, :class:`ExitAdapter`);
            the draft holds it, the target does not.

    Raises:
        ValueError: ``target`` has no decoder layers, or ``layers`` is empty, unsorted or out of range, or an
            ``exit_adapter`` is given for a model whose final norm is not found.
    """
    layers_attribute, target_layers = _decoder_layers(target)
    count = len(target_layers)
    if not layers or list(layers) != sorted(set(layers)) or not 0 <= layers[0] <= layers[-1] < count:
        raise ValueError(
            f"layers must be ascending unique decoder-layer indices from 0 to {count - 1}, at least one; "
            f"got {layers!r}."
        )
    config = copy.deepcopy(target.config)
    config.num_hidden_layers = len(layers)
    if getattr(config, "layer_types", None) is not None:
        config.layer_types = [config.layer_types[i] for i in layers]
    setattr(config, SELF_DRAFT_ATTRIBUTE, name or f"self:layers:{_spans(layers)}")
    with torch.device("meta"):
        draft = type(target)(config)
    base = target.base_model
    for child_name, child in target.named_children():
        if child is not base:
            setattr(draft, child_name, child)
    for child_name, child in base.named_children():
        if child_name == layers_attribute:
            child = nn.ModuleList(_SharedLayer(target_layers[i], j) for j, i in enumerate(layers))
        setattr(draft.base_model, child_name, child)
    owned = {id(tensor) for tensor in (*target.parameters(), *target.buffers())}
    if any(id(tensor) not in owned for tensor in (*draft.parameters(), *draft.buffers())):
        raise ValueError(
            f"{type(target).__name__} keeps weights outside its decoder's submodules, which a layer self-draft cannot "
            "share: pass a separate draft model, or 'self:int4' / 'self:int8'."
        )
    if exit_adapter is not None:
        norm_name = next((n for n in _FINAL_NORMS if isinstance(getattr(draft.base_model, n, None), nn.Module)), None)
        if norm_name is None:
            raise ValueError(
                f"{type(target).__name__}'s final norm is none of {_FINAL_NORMS}: an exit adapter has nowhere to go. "
                "Use the layer self-draft without one."
            )
        hidden = target.config.get_text_config().hidden_size
        if exit_adapter.down.shape[0] != hidden:
            raise ValueError(
                f"The exit adapter maps {exit_adapter.down.shape[0]} features; {type(target).__name__}'s hidden size "
                f"is {hidden}: it was tuned for another model."
            )
        setattr(draft.base_model, norm_name, _AdaptedNorm(getattr(draft.base_model, norm_name), exit_adapter))
    return draft.eval()


def save_tuned_exit(path: str | os.PathLike, layers: Sequence[int], adapter: ExitAdapter) -> None:
    """Writes a tuned exit: the adapter's weights and the layers it follows (safetensors, layers in its metadata)."""
    save_file({"down": adapter.down.detach().contiguous(), "up": adapter.up.detach().contiguous()}, os.fspath(path),
              metadata={"layers": _spans(layers)})


def load_tuned_exit(target: PreTrainedModel, path: str | os.PathLike) -> PreTrainedModel:
    """The layer self-draft a tuned exit file describes (:func:`save_tuned_exit`), over ``target``'s layers.

    Raises:
        FileNotFoundError: ``path`` is missing.
        ValueError: the file is not a tuned exit, or it was tuned for a model of another shape.
    """
    with safe_open(os.fspath(path), framework="pt") as file:
        metadata = file.metadata() or {}
        if "layers" not in metadata or set(file.keys()) != {"down", "up"}:
            raise ValueError(f"{path} is not a tuned exit (specexec-hf distill --stage exit writes one).")
        down, up = file.get_tensor("down"), file.get_tensor("up")
    count = len(_decoder_layers(target)[1])
    layers = _parse_layers(metadata["layers"], count, f"the tuned exit {path}")
    adapter = ExitAdapter(down.shape[0], down.shape[1]).to(down.dtype)  # loads the stored values unrounded
    adapter.load_state_dict({"down": down, "up": up})
    adapter.to(execution_device(target))
    return layer_self_draft(target, layers, f"self:layers:{_spans(layers)}+tuned exit", exit_adapter=adapter)


def resolve_draft(target: PreTrainedModel, draft: PreTrainedModel | str) -> PreTrainedModel:
    """The draft model ``draft`` names for ``target``: a model as given, or a self-draft by name.

    Self-drafts: ``"self:int4"`` / ``"self:int8"`` (the target quantized, :func:`self_draft`), ``"self:exit:K"`` /
    ``"self:skip:<layers>"`` / ``"self:exit"`` / ``"self:skip"`` (the target's own layers, :func:`layer_spec`,
    :func:`layer_self_draft`). Each is built once per target and name and reused afterwards.

    Args:
        target: The target model.
        draft: A causal LM sharing the target's tokenizer, or the name of a self-draft.

    Raises:
        ValueError: ``draft`` is a string other than the self-draft names, a malformed layer spec, or neither a
            model nor a string.
    """
    if isinstance(draft, PreTrainedModel):
        return draft
    is_layer_draft = isinstance(draft, str) and any(
        draft == prefix or draft.startswith(prefix + ":") for prefix in LAYER_SELF_DRAFTS
    )
    if not isinstance(draft, str) or not (draft in SELF_DRAFTS or is_layer_draft):
        raise ValueError(
            f"The draft must be a causal LM sharing the target's tokenizer or one of {sorted(SELF_DRAFTS)} (the "
            "target itself, weight-quantized), 'self:exit:K' (its first K layers) or 'self:skip:<layers>' (all its "
            f"layers but those, e.g. 'self:skip:10-20'), got {draft!r}."
        )
    name, layers = layer_spec(target, draft) if is_layer_draft else (draft, None)
    built = _built.setdefault(target, {})
    if name not in built:
        built[name] = (
            self_draft(target, SELF_DRAFTS[name]) if layers is None else layer_self_draft(target, layers, name)
        )
    return built[name]


register_draft_resolver(resolve_draft)
