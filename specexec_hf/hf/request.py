"""What a ``generate()`` call asks of SpecExec, checked before anything large is allocated.

Everything ``generate()`` hands the ``custom_generate`` callable is either used the way plain decoding uses it
(the prompt, its ``attention_mask`` and ``position_ids``, per-token inputs such as ``token_type_ids``), replaced by
SpecExec's own bookkeeping (the KV cache, ``use_cache``, ``logits_to_keep``, ``cache_position``), or refused with a
message naming it: nothing is silently dropped.

An ``attention_mask`` may hold zeros anywhere (left padding, right padding, holes). Leading zeros are stripped; the
other masked tokens stay in the sequence and in the cache, hidden as keys from every query, and each token sits at
the position ``generate()`` gives it (``position_ids``, which it derives from the mask), exactly as plain decoding.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch
from transformers import DynamicCache, GenerationConfig, PreTrainedModel

from .attention_spans import attention_spans
from .compat import execution_device, logits_width, usable_vocabulary_size

# generate()'s own decoding bookkeeping and output flags, which SpecExec's loop replaces or honours itself.
REPLACED_INPUTS = frozenset({
    "use_cache", "logits_to_keep", "cache_position", "past_key_values", "position_ids", "output_attentions",
    "output_hidden_states", "return_dict",
})
# Per-token inputs that plain decoding extends for every new token by repeating the last value.
PER_TOKEN_INPUTS = ("token_type_ids",)
# Bytes per (query, key) pair of a forward: the bool pattern, the float mask and one head's attention score.
_PAIR_BYTES = 1 + 4 + 4


@dataclass
class Request:
    """A validated call: the unpadded prompt and what plain decoding would feed alongside each token.

    Args:
        input_ids: ``[1, L]`` prompt without its left padding.
        left_padding: ``[1, P]`` padding tokens, put back in front of the output.
        per_token_inputs: ``{name: [1, L]}`` inputs such as ``token_type_ids``, for the unpadded prompt.
        attended: ``[L]`` bool, which prompt tokens other tokens may attend to (the ``attention_mask``'s ones).
        positions: ``[L]`` the prompt tokens' positions; each new token takes the previous one's plus one.
    """

    input_ids: torch.Tensor
    left_padding: torch.Tensor
    per_token_inputs: dict[str, torch.Tensor]
    attended: torch.Tensor
    positions: torch.Tensor

    @cached_property
    def has_masked_tokens(self) -> bool:
        # Read every step; the prompt's mask never changes.
        return not bool(self.attended.all())

    def positions_of(self, start: int, stop: int) -> torch.Tensor:
        """Positions of committed tokens ``[start, stop)`` (counted without the left padding)."""
        prompt_length = self.positions.numel()
        generated = torch.arange(max(start, prompt_length), max(stop, prompt_length)) - prompt_length + 1
        return torch.cat([self.positions[start:stop], self.positions[-1] + generated])

    def attended_keys(self, length: int) -> torch.Tensor:
        """``[length]`` bool: which of the first ``length`` committed tokens are visible as keys."""
        return torch.cat([self.attended[:length], self.attended.new_ones(max(length - self.attended.numel(), 0))])

    def draft_history(self, committed: torch.Tensor) -> torch.Tensor:
        """The ``[1, n]`` tokens the draft continues: ``committed`` (unpadded) without its masked prompt tokens,
        whose positions then run 0, 1, ... as ``generate()`` places the tokens the mask keeps."""
        if not self.has_masked_tokens:
            return committed
        return committed[:, self.attended_keys(committed.shape[1]).to(committed.device)]

    def inputs_for(self, start: int, length: int, num_nodes: int) -> dict[str, torch.Tensor]:
        """Per-token inputs of a forward over committed tokens ``[start, length)`` and then ``num_nodes`` tree nodes;
        tokens past the prompt take the prompt's last value, as ``generate()`` extends them."""
        inputs = {}
        for name, values in self.per_token_inputs.items():
            prompt_part = values[:, start:length]
            extension = values[:, -1:].expand(-1, max(length - max(start, values.shape[1]), 0) + num_nodes)
            inputs[name] = torch.cat([prompt_part, extension], dim=-1)
        return inputs


def validate_request(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    generation_config: GenerationConfig,
    model_kwargs: dict[str, Any],
    synced_gpus: bool,
) -> Request:
    """Checks a ``generate()`` call of one sequence for SpecExec and strips its prompt's left padding.

    Raises:
        ValueError: with what is wrong and what to do instead.
    """
    if input_ids.shape[0] != 1:
        raise ValueError(
            f"validate_request checks one sequence, got a batch of {input_ids.shape[0]}: use validate_batch."
        )
    return validate_batch(model, input_ids, generation_config, model_kwargs, synced_gpus)[0]


def validate_batch(
    model: PreTrainedModel,
    input_ids: torch.Tensor,
    generation_config: GenerationConfig,
    model_kwargs: dict[str, Any],
    synced_gpus: bool,
) -> list[Request]:
    """Checks a ``generate()`` call for SpecExec: one :class:`Request` per row of ``input_ids`` (``[batch, L]``),
    each without its left padding.

    Raises:
        ValueError: with what is wrong (and which row) and what to do instead.
    """
    # generate() has already expanded the batch for beams and return sequences: name those first.
    if generation_config.num_beams > 1 or generation_config.num_return_sequences > 1:
        raise ValueError("SpecExec supports num_beams=1 and num_return_sequences=1 only.")
    if synced_gpus:
        raise ValueError("SpecExec does not support synced_gpus (DeepSpeed ZeRO-3 / FSDP generation).")
    cache = model_kwargs.get("past_key_values")
    if cache is not None and (not isinstance(cache, DynamicCache) or cache.get_seq_length() > 0):
        raise ValueError(
            "SpecExec manages the target's KV cache itself: pass no past_key_values and leave cache_implementation "
            f"unset (got {type(cache).__name__})."
        )
    handled = REPLACED_INPUTS | {"attention_mask", *PER_TOKEN_INPUTS}
    unknown = sorted(name for name, value in model_kwargs.items() if _carries_something(value) and name not in handled)
    if unknown:
        raise ValueError(
            f"SpecExec does not pass {unknown} to the target's tree forward, so it cannot guarantee the target's own "
            "output with them; call generate() without them, or without speculator='specexec'."
        )
    rows = input_ids.shape[0]
    if rows == 1:
        return [_row_request(model, input_ids, generation_config, model_kwargs)]
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is not None and attention_mask.shape == input_ids.shape:
        empty = (~attention_mask.bool().any(dim=-1)).nonzero().flatten().tolist()
        if empty:
            raise ValueError(
                f"Row {empty[0]} of the batch is all padding (its attention_mask is all zeros): SpecExec continues a "
                "prompt. Drop the row, or give it at least one token (e.g. the BOS token)."
            )
    requests = []
    for row in range(rows):
        row_kwargs = {
            name: value[row : row + 1] if isinstance(value, torch.Tensor) and value.shape[:1] == (rows,) else value
            for name, value in model_kwargs.items()
        }
        try:
            requests.append(_row_request(model, input_ids[row : row + 1], generation_config, row_kwargs))
        except ValueError as error:
            raise ValueError(f"Row {row} of the batch: {error}") from None
    return requests


def _row_request(
    model: PreTrainedModel, input_ids: torch.Tensor, generation_config: GenerationConfig, model_kwargs: dict[str, Any]
) -> Request:
    """One row's :class:`Request` (``input_ids`` ``[1, L]``, ``model_kwargs`` that row's), checked."""
    attention_mask = model_kwargs.get("attention_mask")
    padding = _left_padding(attention_mask, input_ids.shape[1])
    prompt = input_ids[:, padding:]
    if padding and (generation_config.output_attentions or generation_config.output_hidden_states):
        raise ValueError(
            "SpecExec decodes a left-padded prompt without its padding, so it cannot return the padding's hidden "
            "states or attentions: drop output_hidden_states/output_attentions, or the padding."
        )
    if prompt.shape[1] == 0:
        raise ValueError(
            "The prompt is empty: SpecExec continues a prompt, so pass at least one token (e.g. the BOS token)."
        )
    vocab = usable_vocabulary_size(model)
    outside = prompt[(prompt < 0) | (prompt >= vocab)]
    if outside.numel():
        raise ValueError(
            f"The prompt holds token id {int(outside[0])}, outside the target's vocabulary of {vocab} ids: check that "
            "it was encoded with the target's tokenizer."
        )
    attended = torch.ones(input_ids.shape[1], dtype=torch.bool) if attention_mask is None else attention_mask[0].bool()
    attended = attended.cpu()[padding:]  # starts with a token the mask keeps
    _check_every_query_sees_a_key(model, attended)
    positions = model_kwargs.get("position_ids")
    if positions is None:  # generate() derives them from the mask the same way
        positions = (attended.long().cumsum(-1) - 1).masked_fill(~attended, 0)[None]
    elif positions.shape != input_ids.shape:
        raise ValueError(
            f"SpecExec takes position_ids of the prompt's shape {tuple(input_ids.shape)}, got {tuple(positions.shape)} "
            "(multi-dimensional positions such as M-RoPE's are not supported)."
        )
    else:
        positions = positions[:, padding:]
    per_token = {}
    for name in PER_TOKEN_INPUTS:
        values = model_kwargs.get(name)
        if values is not None:
            if values.shape != input_ids.shape:
                raise ValueError(f"{name} has shape {tuple(values.shape)}; the prompt has {tuple(input_ids.shape)}.")
            per_token[name] = values
    per_token = {name: values[:, padding:] for name, values in _fed_by_generate(model, input_ids, per_token).items()}
    return Request(prompt, input_ids[:, :padding], per_token, attended, positions[0].cpu().long())


def _fed_by_generate(
    model: PreTrainedModel, input_ids: torch.Tensor, per_token: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """The per-token inputs that plain decoding feeds the model: those its ``prepare_inputs_for_generation`` keeps
    (CTRL's, for one, drops ``token_type_ids`` and lets the model build its own).

    Raises:
        ValueError: when it feeds one changed, which SpecExec cannot follow token by token.
    """
    if not per_token:
        return per_token
    fed = model.prepare_inputs_for_generation(
        input_ids, past_key_values=DynamicCache(config=model.config), use_cache=True, is_first_iteration=True,
        **per_token,
    )
    kept = {}
    for name, values in per_token.items():
        if fed.get(name) is None:
            continue
        if not torch.equal(fed[name], values):
            raise ValueError(
                f"{type(model).__name__}.prepare_inputs_for_generation changes {name} before the forward, so SpecExec "
                f"cannot extend it over a tree as plain decoding would; call generate() without {name}."
            )
        kept[name] = values
    return kept


def _carries_something(value: Any) -> bool:
    """Whether a model input holds anything (``generate()`` adds some inputs as ``None`` or empty containers)."""
    if isinstance(value, (dict, list, tuple)):
        return len(value) > 0
    return value is not None


def _left_padding(attention_mask: torch.Tensor | None, length: int) -> int:
    """How many leading tokens ``attention_mask`` pads away."""
    if attention_mask is None:
        return 0
    if attention_mask.shape != (1, length):
        raise ValueError(
            f"The attention_mask has shape {tuple(attention_mask.shape)}; SpecExec takes a 2-D mask of the prompt's "
            f"shape (1, {length})."
        )
    return int((~attention_mask[0].bool()).cumprod(0).sum())  # the leading run of zeros


def _check_every_query_sees_a_key(model: PreTrainedModel, attended: torch.Tensor) -> None:
    """Refuses a mask that leaves a masked prompt token no attended key inside its sliding window or chunk, unless
    the model runs SDPA. Eager attention then gives that token the average of every value in the forward (NaNs in
    float64, which spread to every later token), which depends on what else the forward holds: SpecExec's tree
    forward holds other tokens than plain decoding's, so it cannot reproduce it."""
    if model.config._attn_implementation == "sdpa":  # SDPA gives such a query zeros, as SpecExec does
        return
    for kind, span in attention_spans(model.config).items():
        blind = span.sees_no_key(attended).nonzero()
        if blind.numel():
            raise ValueError(
                f"The attention_mask leaves prompt token {int(blind[0])} (after any left padding) no unmasked token "
                f"within its {kind} span; {model.config._attn_implementation} attention then averages every value "
                "in the forward for it (NaNs in float64), which SpecExec cannot reproduce. Unmask a token within "
                "each window, or load the model with attn_implementation='sdpa'."
            )


def check_budget_fits(model: PreTrainedModel, prompt_length: int, max_length: int, budget: int, rows: int = 1) -> None:
    """Refuses a ``budget`` (or a batch of ``rows`` sequences) whose target forward cannot hold its masks and attention
    scores in memory.

    The first forward scores the whole prompt plus ``budget + 1`` tree nodes against as many keys, per row; its bool
    and float masks and one head's attention scores grow with the square of that, the rest linearly.

    Args:
        prompt_length: The longest row's prompt (without left padding).
        rows: Sequences scored in each forward.

    Raises:
        ValueError: naming the memory needed, what is free and the largest budget (or batch) that fits.
    """
    available = _free_bytes(execution_device(model))
    if available is None:
        return

    width = model.config.get_text_config(decoder=True).hidden_size

    def needed(nodes: int, batch: int = 1) -> int:
        # The first forward feeds the prompt and the tree; later ones a few tokens and the tree, over a longer cache.
        pairs = max((prompt_length + nodes) ** 2, (1 + nodes) * (max_length + nodes))
        return batch * (pairs * _PAIR_BYTES + (prompt_length + nodes) * (16 * width + 4 * logits_width(model)))

    if needed(budget + 1, rows) <= available:
        return
    if rows > 1 and needed(budget + 1) <= available:
        largest = available // needed(budget + 1)  # the cost grows linearly with the batch
        raise ValueError(
            f"A batch of {rows} at budget={budget} needs about {needed(budget + 1, rows) / 2**30:.1f} GiB for the "
            f"target forward's masks and attention, more than the {available / 2**30:.1f} GiB free here; the largest "
            f"batch that fits is about {largest}: pass fewer prompts per call (a pipeline's batch_size={largest})."
        )
    low, high = 0, budget  # the largest budget that fits, by bisection
    while low < high:
        middle = (low + high + 1) // 2
        low, high = (middle, high) if needed(middle + 1) <= available else (low, middle - 1)
    raise ValueError(
        f"budget={budget} needs about {needed(budget + 1) / 2**30:.1f} GiB for the target forward's masks and "
        f"attention over {prompt_length + budget + 1} tokens, more than the {available / 2**30:.1f} GiB free "
        + (f"here; the largest budget that fits is about {low}." if low else "here, for any budget.")
    )


def _free_bytes(device: torch.device) -> int | None:
    """Free memory where the target computes (``None`` when it cannot be told)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    if device.type == "cpu" and hasattr(os, "sysconf"):
        try:
            return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (ValueError, OSError):
            return None
    return None
