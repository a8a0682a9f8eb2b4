"""Greedy speculative decoding in 16-bit against plain greedy in the same dtype: how often the outputs part, where,
and whether the near-tie detector (``specexec_hf.core.precision``) saw it coming.

A tree forward (or a chain of draft tokens verified at once) runs other kernel shapes than the one-token forwards of
plain decoding, so its logits round differently; where the target's top two scores are within that rounding, either
token can win. For each model, dtype and path this records, per prompt, the first position where the path's tokens
differ from the reference (plain greedy on the same stack in the same dtype: ``generate()`` for the Hugging Face paths,
a vLLM engine without speculation for the vLLM ones) and whether that choice was near-tied: the detector applied to the
target's logits at that position, teacher-forced on the reference's tokens before it, and, for SpecExec, whether its
own ``specexec_stats.near_tied_positions`` held it. A flip at a choice the detector did not flag would mean the
bound is too tight; the run reports those as ``undetected``.

Paths: ``specexec`` (this library's ``generate()``), ``specexec_self`` (the target as its own draft),
``assisted`` (transformers' assisted generation), ``vllm_draft_model`` (vLLM's ``draft_model`` method, k 4) and
``vllm_tree`` (SpecExec's vLLM proposer with ``tree_verification``). Models: ``default`` (SmolLM2-135M-Instruct and
the shipped draft, cast to the dtype), ``tiny`` (the synthetic random pair of ``synthetic_models.py``: hidden size 64,
2 layers, draft = target + 10% noise) and ``random`` (a wider random Llama on the same tokenizer: hidden size 256,
4 layers, 2048 output rows, its head scaled by 8; draft = target + 10% noise). float32 is the control.
End-of-sequence tokens neither stop nor are masked (as vLLM's ``ignore_eos``), so every output is ``--max-tokens``
long.

    OMP_NUM_THREADS=1 python -m benchmarks.precision_flips --output-dir benchmarks/results/precision_flips
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from benchmarks.report import write_report
from benchmarks.synthetic_models import make_tiny_pair
from benchmarks.vllm_acceptance import PROMPTS, run_method

HF_PATHS = ("specexec", "specexec_self", "assisted")
VLLM_PATHS = {"vllm_draft_model": "draft_model", "vllm_tree": "specexec_tree"}
DTYPES = ("float32", "bfloat16", "float16")


def save_random_pair(directory: Path, tokenizer_dir: Path) -> dict[str, str]:
    """The ``random`` model: a wider random Llama than the tiny pair's, and its noisy copy, saved with the tiny
    pair's tokenizer (whose ids all fall below its 2048 rows)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=2048, hidden_size=256, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, bos_token_id=0, eos_token_id=1, tie_word_embeddings=False,
    )  # fmt: skip
    torch.manual_seed(0)
    target = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        target.lm_head.weight.mul_(8.0)  # peaked next-token distributions, as a trained model's
    draft = LlamaForCausalLM(config).eval()
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for weight in draft.parameters():
            weight.add_(torch.randn_like(weight) * weight.std() * 0.1)
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    paths = {"target": str(directory / "target"), "draft": str(directory / "draft")}
    for model, path in ((target, paths["target"]), (draft, paths["draft"])):
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return paths


def first_difference(reference: list[int], tokens: list[int]) -> int | None:
    """The first position where ``tokens`` differs from ``reference`` (a shorter one differs where it ends)."""
    for position, (want, got) in enumerate(zip(reference, tokens)):
        if want != got:
            return position
    return None if len(reference) == len(tokens) else min(len(reference), len(tokens))


def near_tied_at(target: Any, prompt: list[int], reference: list[int], position: int) -> bool:
    """Whether the target's choice after ``prompt + reference[:position]`` is near-tied, by the detector, on logits
    from one teacher-forced forward in the target's dtype."""
    from specexec_hf.core.precision import greedy_choice

    ids = torch.tensor([prompt + reference[:position]])
    with torch.no_grad():
        logits = target(ids).logits[0, -1].float()
    width = target.config.get_text_config().hidden_size
    return bool(greedy_choice(logits, torch.finfo(target.dtype).eps, width)[1])


def load_pair(model: str, dtype: torch.dtype, paths: dict[str, str]) -> tuple[Any, Any, Any]:
    """The model's HF target, draft and tokenizer in ``dtype``, end-of-sequence switched off."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import specexec_hf

    if model == "default":
        target, draft, tokenizer = specexec_hf.load_default_pair()
        target, draft = target.to(dtype), draft.to(dtype)
    else:
        load = dict(dtype=dtype, attn_implementation="sdpa")
        target = AutoModelForCausalLM.from_pretrained(paths["target"], **load).eval()
        draft = AutoModelForCausalLM.from_pretrained(paths["draft"], **load).eval()
        tokenizer = AutoTokenizer.from_pretrained(paths["target"])
    for m in (target, draft):
        m.generation_config.eos_token_id = None
        m.generation_config.pad_token_id = 0
    return target, draft, tokenizer


def run_hf(
    model: str, dtype_name: str, paths: dict[str, str], args: argparse.Namespace
) -> tuple[list[dict[str, Any]], Any, list[list[int]]]:
    """Plain greedy and the Hugging Face paths on every prompt; also the target and the prompts' ids, for vLLM."""
    from specexec_hf import SpecExecStats
    from specexec_hf.core.precision import greedy_choice
    from specexec_hf.hf.learnt_state import LearntState

    dtype = getattr(torch, dtype_name)
    target, draft, tokenizer = load_pair(model, dtype, paths)
    eps, width = torch.finfo(dtype).eps, target.config.get_text_config().hidden_size
    prompts = [tokenizer(text).input_ids for text in PROMPTS]
    references, tied = [], []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = target.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=args.max_tokens, do_sample=False,
            output_scores=True, return_dict_in_generate=True,
        )  # fmt: skip
        references.append(out.sequences[0, len(prompt) :].tolist())
        tied += [int(greedy_choice(scores, eps, width)[1]) for scores in out.scores]
    plain = {"model": model, "dtype": dtype_name, "path": "plain", "near_tied_choices": sum(tied), "choices": len(tied)}
    rows = [plain]
    for path in args.paths:
        if path not in HF_PATHS:
            continue
        drafter = target if path == "specexec_self" else draft
        started = time.perf_counter()
        outputs, stats_list = [], []
        try:
            learnt = LearntState()  # each path learns from its own walks only
            for prompt in prompts:
                ids = torch.tensor([prompt])
                kwargs: dict[str, Any] = dict(
                    attention_mask=torch.ones_like(ids), max_new_tokens=args.max_tokens, do_sample=False,
                    assistant_model=drafter,
                )
                stats = SpecExecStats()
                if path != "assisted":
                    kwargs.update(speculator="specexec", budget=args.budget, specexec_stats=stats, learnt_state=learnt)
                outputs.append(target.generate(ids, **kwargs)[0, len(prompt) :].tolist())
                stats_list.append(stats)
        except Exception as error:  # noqa: BLE001 - reported in the table
            rows.append(error_row(model, dtype_name, path, error))
            continue
        seconds = time.perf_counter() - started
        rows.append(compare(model, dtype_name, path, prompts, references, outputs, target, seconds,
                            None if path == "assisted" else stats_list))  # fmt: skip
    return rows, target, prompts


def compare(
    model: str, dtype: str, path: str, prompts: list[list[int]], references: list[list[int]],
    outputs: list[list[int]], target: Any, seconds: float, stats_list: list[Any] | None,
) -> dict[str, Any]:  # fmt: skip
    """One table row: which prompts differ from the reference, where, and whether the detector flagged it."""
    divergences = []
    for index, (prompt, reference, tokens) in enumerate(zip(prompts, references, outputs)):
        position = first_difference(reference, tokens)
        if position is None:
            continue
        flagged = near_tied_at(target, prompt, reference, position)
        own = None if stats_list is None else position in stats_list[index].near_tied_positions
        divergences.append({"prompt": index, "position": position, "near_tied": flagged, "flagged_by_stats": own})
    row: dict[str, Any] = {
        "model": model, "dtype": dtype, "path": path, "prompts": len(prompts), "differing": len(divergences),
        "divergences": divergences, "undetected": sum(not d["near_tied"] for d in divergences),
        "seconds": round(seconds, 2),
    }  # fmt: skip
    if stats_list is not None:
        row["near_ties"] = sum(stats.near_ties for stats in stats_list)
        forwards = sum(stats.target_forwards for stats in stats_list)
        row["tokens_per_target_forward"] = round(sum(s.new_tokens for s in stats_list) / max(forwards, 1), 2)
    return row


def run_vllm(
    model: str, dtype_name: str, paths: dict[str, str], prompts: list[list[int]], target: Any, args: argparse.Namespace
) -> list[dict[str, Any]]:
    """vLLM without speculation (the reference) and the vLLM paths; an engine that cannot start is reported."""
    wanted = [path for path in args.paths if path in VLLM_PATHS]
    if not wanted:
        return []
    settings = SimpleNamespace(
        dtype=dtype_name, max_model_len=256, temperatures=[0.0], max_tokens=args.max_tokens, draft_temperature=None
    )
    rows = []
    try:
        (reference,) = run_method("none", settings, paths["target"], paths["draft"], args.budget, 4, prompts)
    except Exception as error:  # noqa: BLE001 - reported in the table: e.g. a dtype this vLLM build refuses
        return [error_row(model, dtype_name, path, error) for path in wanted]
    for path in wanted:
        started = time.perf_counter()
        try:
            (result,) = run_method(
                VLLM_PATHS[path], settings, paths["target"], paths["draft"], args.budget, 4, prompts
            )
        except Exception as error:  # noqa: BLE001 - reported in the table
            rows.append(error_row(model, dtype_name, path, error))
            continue
        row = compare(model, dtype_name, path, prompts, reference.token_ids, result.token_ids, target,
                      time.perf_counter() - started, None)  # fmt: skip
        row["tokens_per_target_forward"] = result.tokens_per_target_step and round(result.tokens_per_target_step, 2)
        rows.append(row)
    return rows


def error_row(model: str, dtype: str, path: str, error: Exception) -> dict[str, Any]:
    """A path that could not run, with the first line of why (the traceback goes to stderr)."""
    traceback.print_exc()
    message = f"{type(error).__name__}: {error}".splitlines()[0][:300]
    return {"model": model, "dtype": dtype, "path": path, "error": message}


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | dtype | path | prompts differing | first divergence (prompt: position) | near-tied there | "
        "undetected | near-ties walked | tokens / target forward |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row["path"] == "plain":
            lines.append(
                f"| {row['model']} | {row['dtype']} | plain (reference) | - | - | - | - | "
                f"{row['near_tied_choices']} of {row['choices']} choices | 1 |"
            )
            continue
        if "error" in row:
            lines.append(f"| {row['model']} | {row['dtype']} | {row['path']} | not run: {row['error']} |||||| ")
            continue
        where = ", ".join(f"{d['prompt']}: {d['position']}" for d in row["divergences"]) or "-"
        tied = ", ".join(
            ("yes" if d["near_tied"] else "NO") + ("" if d["flagged_by_stats"] is None else
                                                  f" (stats: {'yes' if d['flagged_by_stats'] else 'no'})")
            for d in row["divergences"]
        ) or "-"  # fmt: skip
        lines.append(
            f"| {row['model']} | {row['dtype']} | {row['path']} | {row['differing']} of {row['prompts']} | {where} | "
            f"{tied} | {row['undetected']} | {row.get('near_ties', '-')} | "
            f"{row.get('tokens_per_target_forward', '-')} |"
        )
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    models = ["tiny", "random", "default"]
    parser.add_argument("--models", nargs="+", default=models, choices=models)
    parser.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=DTYPES)
    parser.add_argument("--paths", nargs="+", default=[*HF_PATHS, *VLLM_PATHS], choices=[*HF_PATHS, *VLLM_PATHS])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--budget", type=int, default=16, help="SpecExec tree budget (generate() and vLLM's tree).")
    parser.add_argument("--output-dir", type=Path, default=Path("runs/precision_flips"))
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    args.output_dir.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as scratch:
        for model in args.models:
            if model == "default":
                from specexec_hf.models import export_default_pair

                paths = dict(zip(("target", "draft"), map(str, export_default_pair(scratch))))
            else:
                pair = make_tiny_pair(Path(scratch) / "tiny", noise=0.1)
                paths = {"target": str(pair.target), "draft": str(pair.draft)}
                if model == "random":
                    paths = save_random_pair(Path(scratch) / "random", pair.target)
            for dtype in args.dtypes:
                hf_rows, target, prompts = run_hf(model, dtype, paths, args)
                rows += hf_rows
                rows += run_vllm(model, dtype, paths, prompts, target, args)
                write(args, rows, started)  # a checkpoint after every model and dtype
    write(args, rows, started)
    print(markdown(rows))


def write(args: argparse.Namespace, rows: list[dict[str, Any]], started: float) -> None:
    import transformers

    report = {
        "command": " ".join(["python -m benchmarks.precision_flips", *sys.argv[1:]]),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "vllm": _vllm_version(),
        "max_tokens": args.max_tokens,
        "budget": args.budget,
        "prompts": PROMPTS,
        "seconds": round(time.perf_counter() - started, 1),
        "rows": rows,
    }
    write_report(args.output_dir, "precision_flips", report, markdown(rows))


def _vllm_version() -> str | None:
    try:
        import vllm
    except ImportError:
        return None
    return vllm.__version__


if __name__ == "__main__":
    main()
