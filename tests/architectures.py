"""The architecture matrix: every causal LM class transformers registers, built tiny, run greedy through SpecExec.

For each ``model_type`` in ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` the default config is shrunk (hidden size 64,
a few layers covering every declared layer type, 4 heads, vocabulary 128, a few experts, windows of 8 tokens)
and the model is built in float32 with random weights. Greedy SpecExec must then return exactly what plain
greedy ``generate()`` returns, for prompts shorter and longer than any window the config declares, or refuse
with :class:`~specexec_hf.hf.compat.UnsupportedModelError`. Anything else is a bug: a silent mismatch or a crash.

Run the whole matrix and write its table::

    .venv/bin/python tests/architectures.py --table architectures.md [--only llama,gpt2] [--time-limit 120]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import functools
import io
import itertools
import logging
import re
import signal
import sys
import time
import warnings
from dataclasses import dataclass

import torch
import transformers
from transformers import AutoConfig
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import specexec_hf  # noqa: F401  (installs generate(speculator="specexec"))
from specexec_hf import SpecExecStats
from specexec_hf.hf.compat import UnsupportedModelError

VOCAB = 128
HIDDEN = 64
HEADS = 4
HEAD_DIM = HIDDEN // HEADS
WINDOW = 8
MAX_POSITIONS = 256
MAX_PARAMETERS = 10_000_000
MAX_LAYERS = 8  # a longer prefix of the default layer pattern is replaced by one layer of each type

# Prompts: shorter than any window, and longer than every window (windows are all shrunk to WINDOW tokens).
SHORT_PROMPT = 5
LONG_PROMPT = 3 * WINDOW + 1

# Scalar config fields, by meaning; each is overridden where the default config has it (also where it is None,
# unless None means "off" there, see _NONE_MEANS_OFF).
_SIZES: dict[tuple[str, ...], int] = {
    ("hidden_size", "n_embd", "n_embed", "d_model", "embed_dim", "emb_dim", "embedding_dim", "embedding_size",
     "word_embed_proj_dim", "input_embedding_size", "output_embedding_size", "lru_width",
     "backbone_hidden_size", "hidden_size_global"): HIDDEN,
    ("num_attention_heads", "n_head", "n_heads", "num_heads", "attention_heads", "decoder_attention_heads",
     "encoder_attention_heads", "num_decoder_attention_heads", "num_encoder_attention_heads",
     "swa_num_attention_heads"): HEADS,
    ("head_dim", "d_head", "dim_head", "kv_channels", "attention_head_size",
     "swa_head_dim", "qk_head_dim", "v_head_dim", "index_head_dim", "linear_head_dim"): HEAD_DIM,
    ("qk_rope_head_dim", "qk_nope_head_dim"): HEAD_DIM // 2,
    ("kv_lora_rank", "q_lora_rank", "o_lora_rank"): 32,
    ("intermediate_size", "n_inner", "ffn_dim", "d_ff", "dim_ff", "dff", "d_inner", "decoder_ffn_dim",
     "encoder_ffn_dim", "feed_forward_size", "ffn_hidden_size", "intermediate_size_mlp", "dense_intermediate_size",
     "shared_intermediate_size"): 2 * HIDDEN,
    ("moe_intermediate_size", "shared_expert_intermediate_size", "moe_shared_expert_intermediate_size",
     "expert_ffn_hidden_size"): HIDDEN,
    ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts"): 4,
    ("num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k"): 2,
    ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts"): 1,
    ("n_group", "topk_group", "num_expert_group"): 1,
    ("index_n_heads",): 2,
    ("index_topk",): WINDOW,
    ("linear_num_key_heads",): 2,
    ("linear_num_value_heads", "linear_num_heads"): HEADS,
    ("linear_key_head_dim", "linear_value_head_dim"): HEAD_DIM,
    ("mamba_d_state", "state_size", "ssm_state_size"): 16,
    ("vocab_size", "decoder_vocab_size", "vocab_size_per_layer_input"): VOCAB,
    ("pronunciation_vocab_size", "shape_vocab_size", "encoder_hash_byte_group_vocab"): 32,
    ("hidden_size_per_layer_input",): 8,
    ("max_position_embeddings", "n_positions", "n_ctx", "max_seq_len", "context_length", "max_target_positions",
     "seq_length", "model_max_length"): MAX_POSITIONS,
    ("first_k_dense_replace", "num_dense_layers", "num_nextn_predict_layers"): 1,
}
_LAYER_COUNTS = ("num_hidden_layers", "n_layer", "n_layers", "num_layers", "decoder_layers", "encoder_layers",
                 "num_decoder_layers", "num_encoder_layers", "num_blocks")
_NONE_MEANS_OFF = frozenset({"q_lora_rank", "o_lora_rank", "n_inner", "n_shared_experts", "num_shared_experts",
                             "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size",
                             "moe_shared_expert_intermediate_size", "kv_lora_rank", "first_k_dense_replace",
                             "num_nextn_predict_layers", "index_topk", "d_ff", "ffn_dim", "embedding_size",
                             "word_embed_proj_dim", "hidden_size_per_layer_input", "vocab_size_per_layer_input",
                             "max_target_positions", "model_max_length", "seq_length"})
_KV_HEADS = ("num_key_value_heads", "num_kv_heads", "swa_num_key_value_heads", "n_head_kv", "num_query_groups")
# Window-like fields: shrunk so that LONG_PROMPT exceeds them (left alone where the default disables them).
WINDOW_FIELDS = ("sliding_window", "sliding_window_size", "attention_chunk_size", "window_size",
                 "attention_window_size", "keep_window_size", "local_attention")

# Per model type: fields the generic shrinking gets wrong, or cannot know.
_EXTRA: dict[str, dict] = {
    # Hybrid recurrent models whose default config has no attention layer within a few layers (or none at all,
    # which plain generate() cannot run): one recurrent layer, then one attention layer.
    "bamba": {"attn_layer_indices": [1]},
    "granitemoehybrid": {"layer_types": ["linear_attention", "full_attention"]},
    "jamba": {"attn_layer_period": 2, "attn_layer_offset": 1},
    "zamba": {"num_hidden_layers": 4, "layers_block_type": ["linear_attention", "hybrid"] * 2},  # the shared block is
    # tied across hybrid layers, so it needs two of them
    "xlstm": {"qk_dim_factor": 1.0},  # the default 0.5 gives a recurrent state plain generate() rejects
    "cohere_compass_text": {
        "rope_parameters": {
            "full_attention": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [3, 3, 2]}
        }
    },
    "dots1": {"n_shared_experts": 1},
    "falcon_h1": {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 1, "mamba_d_ssm": 128},
    "gemma3n_text": {  # the last layers reuse the KV of the last earlier layer of their type
        "num_hidden_layers": 4,
        "layer_types": ["sliding_attention", "full_attention"] * 2,
        "num_kv_shared_layers": 2,
        "activation_sparsity_pattern": [0.95, 0.0, 0.0, 0.0],
    },
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"]},
    "mamba2": {"num_heads": 8, "n_groups": 1},
    "qwen4_exp_text": {
        "hc_lowrank": 16,
        "indexer_n_heads": 2,
        "indexer_kv_heads": 1,
        "indexer_head_dim": HEAD_DIM,
        "indexer_budget": WINDOW,
        "indexer_compress_ratio": 2,
    },
    "reformer": {"is_decoder": True, "axial_pos_shape": [16, 16], "axial_pos_embds_dim": [32, 32]},
    "zaya": {"num_experts_per_tok": 1},
}

# Per model type: fixes applied to the built config (defaults that transformers itself cannot build).
_PATCH_CONFIG = {
    # DbrxAttention reads attn_config.rope_theta, a field DbrxAttentionConfig does not declare.
    "dbrx": lambda config: (
        setattr(config.attn_config, "rope_theta", config.rope_parameters["rope_theta"]),
        setattr(config.attn_config, "clip_qkv", 8.0),  # None reaches torch.clamp(min=-None, max=None)
    ),
}

# Per model type: set-up a built model needs before generate().
_PATCH_MODEL = {
    "xmod": lambda model: model.set_default_language(model.config.languages[0]),
}

# Causal LM classes that are not language models on their own.
_NOT_STANDALONE = {
    "gemma4_assistant": "a Gemma 4 drafter head: needs the target's hidden states and shared KV",
    "gemma4_unified_assistant": "a Gemma 4 drafter head: needs the target's hidden states and shared KV",
    "musicgen": "an audio-codebook decoder: its input_ids are [batch * num_codebooks, length], not text",
    "musicgen_melody": "an audio-codebook decoder: its input_ids are [batch * num_codebooks, length], not text",
}

# Model types whose causal LM class is a multimodal wrapper; the text-only decoder is listed separately.
_MULTIMODAL_SUFFIXES = ("ForConditionalGeneration",)


@dataclass
class Tiny:
    """A tiny target and a draft (the target with perturbed weights: same class, same vocabulary)."""

    model_type: str
    class_name: str
    target: torch.nn.Module
    draft: torch.nn.Module
    windows: dict[str, int]


class Skip(Exception):
    """The model type is outside the matrix: multimodal only, not a standalone LM, a duplicate of another entry,
    not buildable tiny on CPU with the installed packages, or plain ``generate()`` itself fails on it."""


def causal_lm_model_types() -> list[str]:
    """Every ``model_type`` transformers maps to a causal LM class."""
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def class_name(model_type: str) -> str:
    return MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type]


def _pattern(types: list) -> list:
    """One of each distinct entry, in order of first appearance."""
    return list(dict.fromkeys(types))


def shrunk_overrides(config) -> dict:
    """Config fields that make ``config`` tiny, consistent with each other."""
    fields = config.to_dict()
    # A None size usually means "derive it" (head_dim) or "unset" (experts); a few mean "off" and stay None.
    present = {key for key, value in fields.items() if value is not None or key not in _NONE_MEANS_OFF}
    overrides: dict = {}
    for keys, value in _SIZES.items():
        overrides.update({key: value for key in keys if key in present})
    heads = fields.get("num_attention_heads") or HEADS
    for key in _KV_HEADS:
        if key in fields and fields[key] is None and key == "num_key_value_heads":
            overrides[key] = HEADS
        elif key in present and isinstance(fields[key], int):
            # Keep the default's kind of attention: multi-head, multi-query or grouped-query.
            overrides[key] = HEADS if fields[key] == heads else (1 if fields[key] == 1 else 2)
    if "head_dim" in fields and fields.get("qk_rope_head_dim"):
        overrides["head_dim"] = overrides["qk_rope_head_dim"]  # multi-head latent attention ropes head_dim dims
    if isinstance(fields.get("rotary_dim"), int):
        overrides["rotary_dim"] = HEAD_DIM // 2
    for key in WINDOW_FIELDS:
        if isinstance(fields.get(key), int) and not isinstance(fields[key], bool) and fields[key] > 0:
            overrides[key] = WINDOW
    # Token ids inside the small vocabulary.
    for key, value in fields.items():
        if key.endswith(("token_id", "token_ids", "token_index")):
            if isinstance(value, int) and not isinstance(value, bool) and value >= VOCAB:
                overrides[key] = value % VOCAB
            elif isinstance(value, list) and all(isinstance(v, int) for v in value):
                overrides[key] = [v % VOCAB for v in value]
    # Layers: enough to hold one layer of each declared type, with every per-layer list consistent.
    layer_lists = {
        key: value
        for key, value in fields.items()
        if isinstance(value, list)
        and value
        and key.endswith(("layer_types", "layers_block_type"))
        and all(isinstance(v, str) for v in value)
    }
    num_layers = 2
    patterns = {}
    for key, value in layer_lists.items():
        distinct = _pattern(value)
        prefix = next(i + 1 for i in range(len(value)) if set(value[: i + 1]) == set(distinct))
        patterns[key] = value[:prefix] if prefix <= MAX_LAYERS else distinct
        num_layers = max(num_layers, len(patterns[key]))
    for key, pattern in patterns.items():
        overrides[key] = list(itertools.islice(itertools.cycle(pattern), num_layers))
    for key in _LAYER_COUNTS:
        if key in present and isinstance(fields[key], int):
            overrides[key] = num_layers
    for key, value in fields.items():
        # Per-layer numeric lists (e.g. activation sparsity) follow the layer count.
        if key not in overrides and isinstance(value, list) and len(value) == fields.get("num_hidden_layers"):
            overrides[key] = value[:num_layers] + value[-1:] * max(0, num_layers - len(value))
    for key, sub in _sub_configs(config).items():
        overrides[key] = _shrunk(sub)
    overrides.update(_EXTRA.get(config.model_type, {}))
    return overrides


def _sub_configs(config) -> dict:
    """The nested configs of a composite config (``text_config``, ``attn_config``, ...), by field name."""
    return {
        key: getattr(config, key)
        for key in getattr(type(config), "sub_configs", {}) or {}
        if hasattr(getattr(config, key, None), "to_dict")
    }


def _shrunk(config):
    """A shrunk copy of a (sub-)config: its class defaults with the shrinking overrides, derived fields rederived."""
    overrides = shrunk_overrides(config)
    try:
        return type(config)(**overrides)
    except Exception:  # noqa: BLE001  (a config that cannot be rebuilt from overrides: patch a copy instead)
        shrunk = copy.deepcopy(config)
        for key, value in overrides.items():
            setattr(shrunk, key, value)
        return shrunk


def _attention_for(model_class) -> str:
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def tiny_config(model_type: str):
    """The default config of ``model_type``, shrunk; raises :class:`Skip` for types outside the matrix."""
    name = class_name(model_type)
    if model_type in _NOT_STANDALONE:
        raise Skip(_NOT_STANDALONE[model_type])
    if name.endswith(_MULTIMODAL_SUFFIXES):
        raise Skip(f"multimodal ({name}); its text decoder has its own entry")
    model_class = getattr(transformers, name)
    try:
        default = AutoConfig.for_model(model_type)
    except Exception as error:  # noqa: BLE001
        try:  # e.g. MusicgenForCausalLM: its own config class builds where the composite one does not
            default = model_class.config_class()
        except Exception:  # noqa: BLE001
            raise Skip(f"default config cannot be built: {type(error).__name__}: {_first_line(error)}") from error
    text = default.get_text_config()
    if text is not default and not isinstance(default, model_class.config_class):
        # A multimodal config whose causal LM class is the text decoder alone: build that from the text config.
        if text.model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and text.model_type != model_type:
            raise Skip(f"same class and config as `{text.model_type}` (the text part of {type(default).__name__})")
        default = text
    # Decoder classes of encoder-decoder families (BartForCausalLM, ...) are decoder-only and stay in the matrix.
    config = type(default)(**shrunk_overrides(default))
    if model_type in _PATCH_CONFIG:
        _PATCH_CONFIG[model_type](config)
    return config


def _first_line(error: BaseException, limit: int = 160) -> str:
    text = str(error).strip().splitlines()[0] if str(error).strip() else ""
    return text[:limit]


@functools.lru_cache(maxsize=4)
def build_tiny(model_type: str, seed: int = 0, draft_noise: float = 0.01) -> Tiny:
    """A tiny float32 target of ``model_type`` in eval mode, seeded, and its draft.

    Raises :class:`Skip` (with the reason) for multimodal-only classes, classes that are not language models on
    their own, and classes that cannot be built tiny on CPU with the installed packages.
    """
    config = tiny_config(model_type)
    model_class = getattr(transformers, class_name(model_type))
    attention = _attention_for(model_class)
    config._attn_implementation = attention
    try:
        with _quiet(), torch.device("meta"):
            skeleton = model_class._from_config(config, attn_implementation=attention)
        size = sum(parameter.numel() for parameter in skeleton.parameters())
        if size > MAX_PARAMETERS:
            raise Skip(f"cannot be built tiny: {size / 1e6:.1f}M parameters after shrinking the config")
        torch.manual_seed(seed)
        with _quiet():
            target = model_class._from_config(config, attn_implementation=attention, dtype=torch.float32)
    except ImportError as error:
        raise Skip(f"needs an extra package: {_first_line(error)}") from error
    except Skip:
        raise
    except Exception as error:
        raise Skip(f"cannot be built tiny: {type(error).__name__}: {_first_line(error)}") from error
    target = target.float().eval()
    if model_type in _PATCH_MODEL:
        _PATCH_MODEL[model_type](target)
    draft = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(draft_noise * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    windows = {key: getattr(config, key) for key in WINDOW_FIELDS if isinstance(getattr(config, key, None), int)}
    return Tiny(model_type, type(target).__name__, target, draft, windows)


@contextlib.contextmanager
def _quiet():
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        logger = logging.getLogger("transformers")
        level = logger.level
        logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            logger.setLevel(level)


def prompt_lengths(tiny: Tiny) -> list[int]:
    """A prompt shorter than every window the config declares, and one longer than all of them."""
    longest = max([v for v in tiny.windows.values() if v and v > 0], default=WINDOW)
    shortest = min([v for v in tiny.windows.values() if v and v > 0], default=WINDOW)
    return [min(SHORT_PROMPT, max(1, shortest - 1)), max(LONG_PROMPT, 2 * longest + 1)]


def _prompt(length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def classify(model_type: str, prompt_len: int, max_new_tokens: int = 12, budget: int = 8, seed: int = 0) -> str:
    """``"exact"``, ``"refused: <message>"``, ``"MISMATCH: ..."`` or ``"crash: <type>: <message>"``.

    Greedy SpecExec on a random ``prompt_len``-token prompt against plain greedy ``generate()``. Raises
    :class:`Skip` for model types outside the matrix, and when plain ``generate()`` itself fails.
    """
    tiny = build_tiny(model_type, seed)
    target, draft = tiny.target, tiny.draft
    ids = _prompt(prompt_len, target.config.get_text_config().vocab_size, seed + prompt_len)
    common = {"do_sample": False, "max_new_tokens": max_new_tokens, "attention_mask": torch.ones_like(ids)}
    try:
        with _quiet(), torch.no_grad():
            expected = target.generate(ids, **common, output_logits=True, return_dict_in_generate=True)
    except Exception as error:
        raise Skip(f"plain generate() fails: {type(error).__name__}: {_first_line(error)}") from error
    stats = SpecExecStats()
    try:
        with _quiet():
            got = target.generate(
                ids, **common, assistant_model=draft, speculator="specexec", budget=budget, specexec_stats=stats
            )
    except UnsupportedModelError as error:
        return f"refused: {error}"
    except Exception as error:  # noqa: BLE001
        return f"crash: {type(error).__name__}: {_first_line(error, 300)}"
    want, have = expected.sequences[0].tolist(), got[0].tolist()
    if want == have:
        if not stats.steps:
            return "crash: SpecExec returned the right tokens without running a single tree step"
        return "exact"
    position = next((i for i, (a, b) in enumerate(zip(want, have)) if a != b), min(len(want), len(have)))
    detail = f"prompt {prompt_len}, first difference at token {position} (new token {position - prompt_len})"
    if position >= len(want) or position >= len(have):
        return f"MISMATCH: {detail}: lengths {len(want)} vs {len(have)}"
    logits = expected.logits[position - prompt_len][0].float()
    top = logits.topk(2).values
    return (
        f"MISMATCH: {detail}: expected {want[position]}, got {have[position]}; "
        f"plain logits gap top-1 vs top-2 {float(top[0] - top[1]):.2e}, "
        f"expected-vs-got {float(logits[want[position]] - logits[have[position]]):.2e}"
    )


def classify_all(model_type: str, max_new_tokens: int = 12, budget: int = 8, seed: int = 0) -> list[tuple[int, str]]:
    """:func:`classify` for a prompt shorter and one longer than any window: ``[(prompt_len, result), ...]``."""
    tiny = build_tiny(model_type, seed)
    return [(n, classify(model_type, n, max_new_tokens, budget, seed)) for n in prompt_lengths(tiny)]


def verdict(results: list[tuple[int, str]]) -> str:
    """The worst of the per-prompt results: crash, then MISMATCH, then refused, then exact."""
    for kind in ("crash", "MISMATCH", "refused", "exact"):
        for _, result in results:
            if result.startswith(kind):
                return result
    return results[0][1]


def short_reason(result: str) -> str:
    """The reason of a refusal in a phrase, for the table: the message without the model's name or advice."""
    message = result.removeprefix("refused: ").strip()
    message = re.sub(r"^The (target|draft) model \([^)]*\)('s)?\s*(\(model_type=[^)]*\)\s*)?", "", message)
    return re.split(r"(?<=[\w\]\)'])\. |; |, so |, which ", message)[0].strip()[:160]


def reason_group(result: str) -> str:
    """The refusal's reason without its details (after a colon), for counting."""
    return short_reason(result).split(":")[0]


class _TimeLimit(Exception):
    pass


@contextlib.contextmanager
def _time_limit(seconds: int):
    def fire(signum, frame):
        raise _TimeLimit(f"over {seconds}s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def run_matrix(model_types, max_new_tokens: int, budget: int, time_limit: int, log=print) -> list[dict]:
    rows = []
    for model_type in model_types:
        start = time.perf_counter()
        row = {"model_type": model_type, "class": class_name(model_type)}
        try:
            with _time_limit(time_limit):
                results = classify_all(model_type, max_new_tokens, budget)
            row["result"] = verdict(results)
            row["per_prompt"] = results
        except Skip as skip:
            row["result"] = f"skipped: {skip}"
        except _TimeLimit as error:
            row["result"] = f"timeout: {error}"
        except Exception as error:  # noqa: BLE001  (building or prompting failed outside classify's guards)
            row["result"] = f"crash: {type(error).__name__}: {_first_line(error, 300)}"
        row["seconds"] = time.perf_counter() - start
        build_tiny.cache_clear()
        rows.append(row)
        log(f"{model_type:28s} {row['seconds']:6.1f}s  {row['result'][:400]}")
    return rows


def category(result: str) -> str:
    if result.startswith("refused"):
        return "refused: " + reason_group(result)
    if result.startswith("skipped"):
        return "skipped"
    return result.split(":", 1)[0]


def markdown_table(rows: list[dict], max_new_tokens: int = 12, budget: int = 8) -> str:
    header = (
        f"transformers {transformers.__version__}; each class built tiny from its default config (random float32 "
        f"weights, windows of {WINDOW} tokens); greedy SpecExec (budget {budget}) vs plain greedy generate(), "
        f"{max_new_tokens} new tokens, prompts of {SHORT_PROMPT} and {LONG_PROMPT} tokens."
    )
    lines = [header, "", "| model_type | class | result |", "|---|---|---|"]
    for row in rows:
        result = row["result"]
        if result.startswith("refused"):
            shown = "refused: " + short_reason(result)
        else:
            shown = result
        shown = shown.replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{row['model_type']}` | `{row['class']}` | {shown} |")
    counts: dict[str, int] = {}
    for row in rows:
        counts[category(row["result"])] = counts.get(category(row["result"]), 0) + 1
    summary = ", ".join(f"{kind}: {n}" for kind, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))
    return "\n".join(lines) + f"\n\n{len(rows)} model types; {summary}.\n"


TABLE_INTRODUCTION = """# Architectures

Every decoder-only causal LM class transformers registers (`MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`), built tiny from
its default config and decoded greedily with SpecExec and with plain `generate()`. A result is `exact` (the same
tokens, with at least one tree step run), `refused` (an `UnsupportedModelError` naming the reason) or `skipped`
(not a standalone text decoder, or plain `generate()` itself fails). A silent mismatch or a crash fails the test.

Regenerate this table (a few minutes on a shared 2-core CPU) and run the matrix as tests, together with
transformers' own assisted-decoding checks (`tests/test_assisted_parity.py`) on every class rated exact:

```bash
.venv/bin/python tests/architectures.py --table docs/architectures.md
.venv/bin/python -m pytest -q -m architectures tests/test_architectures.py tests/test_assisted_parity.py
```

A fast subset of both (without the marker) runs in CI.

"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", help="write the Markdown table here")
    parser.add_argument("--only", help="comma-separated model types (default: all)")
    parser.add_argument("--max-new-tokens", type=int, default=12)
    parser.add_argument("--budget", type=int, default=8)
    parser.add_argument("--time-limit", type=int, default=180, help="seconds per model type")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model_types = args.only.split(",") if args.only else causal_lm_model_types()
    start = time.perf_counter()
    rows = run_matrix(model_types, args.max_new_tokens, args.budget, args.time_limit,
                      log=lambda line: print(line, flush=True))
    table = markdown_table(rows, args.max_new_tokens, args.budget)
    elapsed = time.perf_counter() - start
    print(table.rsplit("\n\n", 1)[-1].strip(), f"({elapsed:.0f}s)", flush=True)
    if args.table:
        with open(args.table, "w") as handle:
            handle.write(TABLE_INTRODUCTION + table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
