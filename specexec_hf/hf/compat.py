"""What SpecExec needs from a transformers model, checked up front with errors that say how to fix it."""

from __future__ import annotations

import inspect
import itertools
from typing import Any

import torch
from transformers import GenerationConfig, PreTrainedModel

from ..core.masks import causal_pattern, chain_and_tree_mask
from .attention_spans import SUPPORTED_LAYER_TYPES, attention_spans, decoder_layer_types
from .forward import VERIFIED_MODEL_TYPES, Feed, model_logits
from .kv import new_cache
from .settings import SPECULATOR_FIELD

SUPPORTED_ATTENTION = ("eager", "sdpa")
# Position biases computed from the 2-D padding mask, which a tree's 4-D mask and positions cannot steer.
ALIBI_MODEL_TYPES = frozenset({"bloom", "mpt"})
PROBE_PREFIX = 6  # committed tokens before the probe's tree, on top of the longest span the config declares
# Config fields that limit which keys a query sees (windows, chunks, top-k key selection): the probe goes past them.
WINDOW_FIELDS = ("sliding_window", "sliding_window_size", "attention_chunk_size", "attention_window_size",
                 "window_size", "keep_window_size", "local_window_size", "local_attention")
# Probe verdicts per (class, configuration, attention implementation, dtype, device): "" passes, else the reason.
_probe_verdicts: dict[tuple, str] = {}


class UnsupportedModelError(ValueError):
    """The model cannot run SpecExec; the message says why and what to do instead."""


def check_supported(model: PreTrainedModel, role: str) -> None:
    """Raises :class:`UnsupportedModelError` unless ``model`` can score token trees exactly.

    Args:
        model: The target or the draft.
        role: ``"target"`` or ``"draft"``, for the message.
    """
    name = f"The {role} model ({type(model).__name__})"
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder; SpecExec supports decoder-only causal LMs.")
    if getattr(model, "_is_stateful", False):
        raise UnsupportedModelError(
            f"{name} is stateful (recurrent state instead of a KV cache), so it cannot score a token tree."
        )
    parameters = inspect.signature(model.forward).parameters
    missing = [arg for arg in ("attention_mask", "position_ids", "past_key_values") if arg not in parameters]
    if missing:
        raise UnsupportedModelError(f"{name}'s forward() lacks {missing}, which tree attention needs.")
    attention = getattr(config, "_attn_implementation", None)
    if attention not in SUPPORTED_ATTENTION:
        raise UnsupportedModelError(
            f"{name} uses attn_implementation={attention!r}, which ignores custom 4-D attention masks. "
            f"Load it with attn_implementation='sdpa' (or 'eager')."
        )
    unsupported = sorted(set(decoder_layer_types(config)) - set(SUPPORTED_LAYER_TYPES))
    if unsupported:
        raise UnsupportedModelError(
            f"{name} has {unsupported} layers (recurrent or compressed state, not a KV cache), so it cannot score "
            f"a token tree; SpecExec supports {list(SUPPORTED_LAYER_TYPES)} layers."
        )
    reason = _position_blind_attention(config)
    if reason:
        raise UnsupportedModelError(f"{name} {reason}, so a token scored inside a tree would not see what it sees "
                                    "in sequence. SpecExec needs attention driven by 4-D masks and position_ids.")
    unloaded = _weight_without_data(model)
    if unloaded:
        raise UnsupportedModelError(
            f"{name} has weights on the meta device that nothing loads (e.g. {unloaded}): it was built under "
            "torch.device('meta') or init_empty_weights() and never given its weights. Load them (from_pretrained "
            "without device_map='meta', or to_empty() then load_state_dict()), or dispatch it with accelerate "
            "(specexec_hf.load_offloaded, or from_pretrained with a device_map), whose hooks load offloaded weights."
        )
    if config.model_type not in VERIFIED_MODEL_TYPES:
        failure = _tree_attention_probe(model)
        if failure:
            raise UnsupportedModelError(
                f"{name} (model_type={config.model_type!r}) failed the tree-attention probe: {failure}. Its "
                "attention does not honour custom 4-D masks and position_ids the way SpecExec needs. Verified "
                "families: " + ", ".join(sorted(VERIFIED_MODEL_TYPES)) + "."
            )


def _weight_without_data(model: PreTrainedModel) -> str | None:
    """The name of a parameter or buffer on the meta device that no accelerate offloading hook (on its module or an
    ancestor) loads before the forward, if any: a forward would fail on it deep inside torch."""
    loading: set[str] = set()  # modules whose hooks load the weights below them
    for module_name, module in model.named_modules():  # parents before children
        hook = getattr(module, "_hf_hook", None)
        if any(getattr(each, "offload", False) for each in getattr(hook, "hooks", [hook])):  # SequentialHook chains
            loading.add(module_name)
        parts = module_name.split(".") if module_name else []
        if any(".".join(parts[:end]) in loading for end in range(len(parts) + 1)):
            continue
        tensors = itertools.chain(module.named_parameters(recurse=False), module.named_buffers(recurse=False))
        for tensor_name, tensor in tensors:
            if tensor.device.type == "meta":
                return f"{module_name}.{tensor_name}" if module_name else tensor_name
    return None


def _position_blind_attention(config: Any) -> str | None:
    """Why the model's attention cannot follow a tree's masks and positions, known from its config alone."""
    if getattr(config, "alibi", False) or config.model_type in ALIBI_MODEL_TYPES:
        return "uses ALiBi position biases built from the 2-D attention mask"
    if "local" in (getattr(config, "attention_layers", None) or ()):
        return "has local-attention layers whose causal bias is indexed by cache slot"
    return None


def logits_width(model: PreTrainedModel) -> int:
    """How many logits ``model`` produces per token (a subset head still produces the full vocabulary's)."""
    head = model.get_output_embeddings()
    return getattr(head, "out_features", None) or head.weight.shape[0]


def usable_vocabulary_size(model: PreTrainedModel) -> int:
    """How many token ids (``0`` up to it) ``model`` both reads (input embedding rows) and scores (logits)."""
    return min(logits_width(model), model.get_input_embeddings().weight.shape[0])


def check_same_tokenizer(tokenizer: Any = None, assistant_tokenizer: Any = None) -> None:
    """Refuses a draft whose tokenizer maps tokens to other ids than the target's, as far as ``generate()`` was
    told: its ``tokenizer=`` (the target's) and ``assistant_tokenizer=`` (the draft's), as HF assisted generation
    takes them, are compared by vocabulary (``get_vocab()``, token to id). The models' sizes prove nothing either
    way: a pair sharing a tokenizer may pad its embeddings to different sizes (Qwen2.5-0.5B-Instruct has 151936
    rows, Qwen2.5-7B-Instruct 152064), so without both tokenizers the draft is taken to share the target's.

    Raises:
        ValueError: when only ``assistant_tokenizer`` is given, or when the two vocabularies differ (the message
            names the first difference).
    """
    if assistant_tokenizer is None:
        return
    if tokenizer is None:
        raise ValueError(
            "assistant_tokenizer= is compared with the target's tokenizer, which generate() was not given: pass "
            "tokenizer=<the target's tokenizer> too, or neither."
        )
    if assistant_tokenizer is tokenizer:
        return
    target_vocab, draft_vocab = tokenizer.get_vocab(), assistant_tokenizer.get_vocab()
    if target_vocab == draft_vocab:
        return
    raise ValueError(
        f"The draft's tokenizer is not the target's: compared by vocabulary (get_vocab(), token -> id; "
        f"{len(draft_vocab)} entries against {len(target_vocab)}), {_first_difference(target_vocab, draft_vocab)}. "
        "SpecExec compares token ids directly, so the draft must use the target's tokenizer (its embeddings may be "
        "padded to another size): pick a draft from the same model family, or distill one with "
        "`specexec-hf distill`. For a draft with another tokenizer, drop speculator='specexec': transformers' "
        "universal assisted decoding translates between tokenizers."
    )


def _first_difference(target_vocab: dict[str, int], draft_vocab: dict[str, int]) -> str:
    """The first token, by the target's ids and then the draft's, that the two vocabularies map differently."""
    for token, index in sorted(target_vocab.items(), key=lambda item: item[1]):
        other = draft_vocab.get(token)
        if other != index:
            where = "absent from the draft's" if other is None else f"id {other} in the draft's"
            return f"the target's token {token!r} is id {index}, {where}"
    index, token = min((index, token) for token, index in draft_vocab.items() if token not in target_vocab)
    return f"the draft's token {token!r} (id {index}) is absent from the target's"


def check_intermediate_vocabulary(target: PreTrainedModel, intermediate: PreTrainedModel) -> None:
    """Raises ``ValueError`` unless a draft hierarchy's intermediate model scores exactly the target's ids (the
    target verifies the tokens it adds to the tree, so it may not be padded to another size, as a draft may)."""
    sizes = logits_width(intermediate), logits_width(target)
    if sizes[0] != sizes[1]:
        raise ValueError(
            f"The intermediate model's vocabulary ({sizes[0]} logits) does not match the target's ({sizes[1]}): "
            "the target verifies the tokens it adds to the draft's tree, so it must use the target's tokenizer and "
            "vocabulary size. Pick an intermediate_model of the target's size, or a \"self:...\" one."
        )


def check_draft_vocabulary(target_vocab_size: int, draft: PreTrainedModel, target_name: str = "target") -> None:
    """Raises ``ValueError`` unless the draft scores exactly the target's ``target_vocab_size`` tokens.

    Args:
        target_vocab_size: Logits the target produces per token.
        draft: The draft model.
        target_name: How the message names the target (e.g. ``"vLLM target"``).
    """
    draft_size = logits_width(draft)
    if draft_size != target_vocab_size:
        raise ValueError(
            f"The draft's vocabulary ({draft_size} logits) does not match the {target_name}'s ({target_vocab_size}). "
            "SpecExec compares token ids directly, so the draft must use the target's tokenizer and vocab_size: "
            "pick a draft from the same model family, or distill one with `specexec-hf distill`."
        )


def execution_device(model: PreTrainedModel) -> torch.device:
    """Where ``model`` takes its inputs: its input embedding's device, or where accelerate runs that embedding
    when its weights are offloaded (left on the meta device), which is the first accelerator in ``hf_device_map``,
    else the CPU, as ``accelerate.dispatch_model`` chooses it."""
    device = model.get_input_embeddings().weight.device
    if device.type != "meta":
        return device
    placements = (getattr(model, "hf_device_map", None) or {}).values()
    accelerator = next((where for where in placements if where not in ("cpu", "disk")), None)
    return torch.device("cpu") if accelerator is None else torch.device(accelerator)


def _probe_key(model: PreTrainedModel, device: torch.device, probe: str) -> tuple:
    return (type(model), model.config.to_json_string(), model.config._attn_implementation, model.dtype, device, probe)


def check_masked_tokens_supported(model: PreTrainedModel) -> None:
    """Raises :class:`UnsupportedModelError` unless ``model``'s own cached decoding treats tokens its attention
    mask hides the way SpecExec does (hidden as keys from every later query), checked numerically per configuration
    for families outside ``VERIFIED_MODEL_TYPES``."""
    if model.config.model_type in VERIFIED_MODEL_TYPES:
        return
    failure = _masked_tokens_probe(model)
    if failure:
        raise UnsupportedModelError(
            f"The target model ({type(model).__name__}) failed the masked-token probe: {failure}. Its cached decoding "
            "does not hide the attention_mask's zeros the way a full forward does, so SpecExec cannot follow it: "
            "drop the masked tokens from the prompt (left padding is fine), or call generate() without "
            "speculator='specexec'."
        )


@torch.no_grad()
def _masked_tokens_probe(model: PreTrainedModel) -> str:
    """Decodes a few tokens after a prompt with masked tokens with plain ``generate()``, scores the same sequence
    the way SpecExec does (masked keys hidden from every query, ``generate()``'s positions) and returns why their
    logits differ ("" when they match)."""
    device = execution_device(model)
    key = _probe_key(model, device, "masked tokens")
    if key in _probe_verdicts:
        return _probe_verdicts[key]
    vocab = model.config.get_text_config(decoder=True).vocab_size
    prompt = torch.randint(vocab, (1, 2 * PROBE_PREFIX), generator=torch.Generator().manual_seed(1)).to(device)
    attended = torch.ones(prompt.shape[1], dtype=torch.bool, device=device)
    attended[1::3] = False  # a hole in every window of three, and a masked last token
    mask = attended.long()[None]
    try:
        # Plain decoding even where the model's own generation config names a speculator.
        plain_decoding = GenerationConfig(
            max_new_tokens=3, min_new_tokens=3, do_sample=False, num_beams=1, output_logits=True,
            return_dict_in_generate=True, pad_token_id=0, **{SPECULATOR_FIELD: None},
        )
        plain = model.generate(prompt, attention_mask=mask, generation_config=plain_decoding)
        count = len(plain.logits)
        tokens = plain.sequences[0, : prompt.shape[1] + count - 1]
        prompt_positions = (attended.long().cumsum(0) - 1).masked_fill(~attended, 0)
        positions = torch.cat([prompt_positions, prompt_positions[-1] + torch.arange(1, count, device=device)])
        keys = torch.cat([attended, attended.new_ones(count - 1)])
        visible = causal_pattern(tokens.numel(), 0, device) & keys
        ours = model_logits(model, Feed(new_cache(), tokens, positions, visible, count,
                                        span_positions=torch.arange(tokens.numel(), device=device)))
        tolerance = 1e-3 if model.dtype == torch.float32 else 3e-2
        verdict = ""
        for step, expected in enumerate(plain.logits):
            if not torch.allclose(ours[step], expected[0].float(), atol=tolerance, rtol=tolerance):
                difference = float((ours[step] - expected[0].float()).abs().max())
                verdict = f"new token {step} gets logits {difference:.3g} away from plain generate()'s"
                break
    except Exception as error:  # noqa: BLE001 - any failure here is a refusal, with its reason
        verdict = f"decoding after masked tokens raised {type(error).__name__}: {error}"
    _probe_verdicts[key] = verdict
    return verdict


@torch.no_grad()
def _tree_attention_probe(model: PreTrainedModel) -> str:
    """Scores a tree the way SpecExec does and each of its paths the model's own way; returns why they differ
    ("" when every committed token's and every node's logits match).

    The committed prefix is longer than any sliding window or chunk the config declares, and the tree has two
    branches at the root, a second level with two siblings and a third level, so a mask or position that
    follows cache slots instead of each node's own path shows. Verdicts are cached per configuration.
    """
    device = execution_device(model)
    key = _probe_key(model, device, "tree")
    if key in _probe_verdicts:
        return _probe_verdicts[key]
    declared = [getattr(model.config.get_text_config(decoder=True), field, None) for field in WINDOW_FIELDS]
    reach = max([span.reach() for span in attention_spans(model.config).values()]
                + [value for value in declared if isinstance(value, int)], default=0)
    limit = getattr(model.config, "max_position_embeddings", None) or reach + PROBE_PREFIX + 4
    prefix_length = max(2, min(reach + PROBE_PREFIX, limit - 4))
    vocab = model.config.get_text_config(decoder=True).vocab_size
    generator = torch.Generator().manual_seed(0)
    prefix = torch.randint(vocab, (prefix_length,), generator=generator).to(device)
    # Nodes 1..5 under the root (the prefix's last token): 1 and 2 at depth 1, 3 and 4 under 1, 5 under 3.
    parents = [-1, 0, 0, 1, 1, 3]
    nodes = torch.randint(vocab, (len(parents) - 1,), generator=generator).to(device)
    depth = [0] * len(parents)
    visible_tree = torch.eye(len(parents), dtype=torch.bool)
    for node in range(1, len(parents)):
        depth[node] = depth[parents[node]] + 1
        visible_tree[node] |= visible_tree[parents[node]]
    tokens = torch.cat([prefix, nodes])
    positions = torch.cat([torch.arange(prefix_length), prefix_length - 1 + torch.tensor(depth[1:])]).to(device)
    visible = chain_and_tree_mask(0, prefix_length, visible_tree.to(device))
    try:
        scored = model_logits(model, Feed(new_cache(), tokens, positions, visible, tokens.numel()))
        tree = scored[prefix_length:]
        tolerance = 1e-3 if model.dtype == torch.float32 else 3e-2
        # Each committed token as the causal prefix it ends: a model whose plain forward lets tokens see later
        # ones (an encoder run as a decoder) differs here far more than at the last token.
        in_sequence = model(input_ids=prefix[None], use_cache=False).logits[0].float()
        behind = (scored[:prefix_length] - in_sequence).abs().amax(dim=-1)
        verdict = ""
        if not torch.allclose(scored[:prefix_length], in_sequence, atol=tolerance, rtol=tolerance):
            verdict = (f"committed token {int(behind.argmax())} gets logits {float(behind.max()):.3g} away from the "
                       "same prefix scored in sequence")
            if getattr(model.config, "is_decoder", None) is False:
                verdict = ("it attends bidirectionally (config.is_decoder=False, set is_decoder=True for a causal "
                           f"decoder): {verdict}")
        for node in range(1, len(parents) if not verdict else 1):
            path = [node]
            while parents[path[-1]] > 0:
                path.append(parents[path[-1]])
            sequence = torch.cat([prefix, nodes[[n - 1 for n in reversed(path)]]])
            reference = model(input_ids=sequence[None], use_cache=False).logits[0, -1].float()
            if not torch.allclose(tree[node - 1], reference, atol=tolerance, rtol=tolerance):
                difference = float((tree[node - 1] - reference).abs().max())
                verdict = (f"node {node} (depth {depth[node]}, after {prefix_length} committed tokens) gets logits "
                           f"{difference:.3g} away from the same path scored in sequence")
                break
    except Exception as error:  # noqa: BLE001 - any failure of the model on a tree is a refusal, with its reason
        verdict = f"its forward over a token tree raised {type(error).__name__}: {error}"
    _probe_verdicts[key] = verdict
    return verdict


def use_sdpa_attention(model: PreTrainedModel) -> PreTrainedModel:
    """Switches ``model`` to SDPA attention, which honours the custom 4-D masks tree attention needs."""
    model.config._attn_implementation = "sdpa"
    return model
