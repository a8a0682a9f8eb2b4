"""Stage 4: the draft's own weights and a JSON with its config and report."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from transformers import PreTrainedModel

from ...models.drafts import INT8_SCALE_SUFFIX, dequantize_rows_int8, quantize_rows_int8
from .evaluate import agreement_report, load_evaluated_draft
from .train import draft_weights


def stored_as_int8(tensor: torch.Tensor) -> bool:
    """Whether an int8 export stores ``tensor`` as int8: its floating matrices; vectors stay float16."""
    return tensor.is_floating_point() and tensor.ndim == 2


def round_trip_int8(weights: dict[str, torch.Tensor]) -> None:
    """Replace each matrix in ``weights`` (tensors sharing the draft's parameters) by its int8 round trip."""
    with torch.no_grad():
        for tensor in weights.values():
            if stored_as_int8(tensor):
                tensor.copy_(dequantize_rows_int8(*quantize_rows_int8(tensor)))


def export_tensors(weights: dict[str, torch.Tensor], export_dtype: str) -> dict[str, torch.Tensor]:
    """The tensors an export file holds, in host memory.

    Floating tensors are cast to ``export_dtype``; with ``"int8"`` each matrix is stored as int8 plus per-row
    scales (``NAME.int8_scale``, see :func:`specexec_hf.models.drafts.quantize_rows_int8`) and vectors as float16.

    Args:
        weights: The draft's own tensors (see :func:`draft_weights`).
        export_dtype: ``"float16"``, ``"bfloat16"``, ``"float32"`` or ``"int8"``.
    """
    stored = {}
    for name, tensor in weights.items():
        tensor = tensor.detach().cpu()
        if export_dtype == "int8" and stored_as_int8(tensor):
            stored[name], stored[name + INT8_SCALE_SUFFIX] = quantize_rows_int8(tensor)
        elif tensor.is_floating_point():
            stored[name] = tensor.to(torch.float16 if export_dtype == "int8" else getattr(torch, export_dtype))
        else:
            stored[name] = tensor
    return {name: tensor.contiguous() for name, tensor in stored.items()}


def export_checkpoint(args: argparse.Namespace, target: PreTrainedModel, tokenizer: Any) -> Path:
    """Stage ``export``: write the draft's weights as safetensors plus a JSON with its config and report.

    The JSON (same name, ``.json``) is what :func:`specexec_hf.models.load_default_pair` reads to rebuild the
    draft's config; it also records the training progress and the held-out agreement report (reused from
    ``OUT/agreement.json`` when it describes the same checkpoint and vocabulary).
    """
    path, draft, spec, saved = load_evaluated_draft(args, target)
    int8 = args.export_dtype == "int8"
    if int8:
        round_trip_int8(draft_weights(draft, spec))  # the report must describe the weights that ship
    report_path = Path(args.out) / "agreement.json"
    report = json.loads(report_path.read_text()) if report_path.is_file() else None
    evaluated = (str(path), saved["state"]["step"], args.draft_vocab or None, int8)
    reported = None if report is None else (
        report["checkpoint"], report["step"], report.get("draft_vocab"), report.get("int8_weights", False)
    )
    if reported != evaluated:
        report = agreement_report(args, path, saved, draft, target, tokenizer, int8_weights=int8)
    destination = Path(args.export_path) if args.export_path else Path(args.out) / "draft.safetensors"
    destination.parent.mkdir(parents=True, exist_ok=True)
    save_file(export_tensors(draft_weights(draft, spec), args.export_dtype), destination)
    destination.chmod(0o644)  # safetensors writes owner-only files; a draft shipped in a package must be readable
    meta = {
        "target": args.target,
        **spec.as_dict(),
        "intermediate_size": draft.config.intermediate_size,
        "draft_vocab": args.draft_vocab or None,
        "dtype": args.export_dtype,
        "training": {key: saved["state"][key] for key in ("step", "epoch", "seconds", "tokens")},
        "val_kl": saved["val_loss"],
        "agreement": report,
    }
    destination.with_suffix(".json").write_text(json.dumps(meta, indent=2) + "\n")
    return destination
