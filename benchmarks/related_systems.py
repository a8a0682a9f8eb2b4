"""SpecExec beside the related systems it is read with (issue 34, item 4), in one run on the disk-streamed target.

The default pair with the target streamed from disk under this process's memory cap exactly as ``ssd.py``'s end-to-end
section runs it (its :func:`ssd.streamed_target`, :func:`ssd.timed`, :func:`ssd.summarize`, :func:`ssd.cap_figures`
and ``memory_cap.py``: every weight on disk, read with ``O_DIRECT`` by the stream executor on every forward, a cap of
the process's own memory plus ``ssd.CACHE_FRACTION`` of the weights, ``prefetch="auto"`` sizing the ring under that
cap), side by side on the same short held-out prompts, greedy and at temperature 0.6. Once the target is loaded the cap
is raised by the drafts' working memory, measured before (:func:`working_bytes`): ``self:int4``'s forwards (quanto's
CPU kernels dequantize its weights on every one) do not fit in what ssd.py's cap leaves beside the ring. Compared:

- plain ``generate()``;
- SpecExec with the shipped draft (its best-first tree) at ``--budgets``;
- ``"self:int4"``: the target itself weight-quantized (optimum-quanto), built from the target in memory before the
  target is streamed, so it sits in RAM under the cap (a streamed target's weights cannot be quantized);
- the layer self-drafts ``--layer-drafts`` (default ``"self:skip:10-20"``, the best of ``results/self_drafts``: 1.70
  / 1.98 tokens per target forward at budgets 16 / 64 in memory, tied with ``self:exit:24``, which runs 5 more
  layers per draft forward). The target's layers are all on disk here, so a layer self-draft streams its layers
  from disk for every draft forward, as the target does;
- Sequoia's static tree learnt online (``tree_search="sequoia"``) with the shipped draft at ``--budgets``;
- TriForce-style hierarchies (``generate(intermediate_model=...)``) at ``--hierarchy-budgets``: the shipped draft grows
  a tree of ``HIERARCHY_DRAFT_FACTOR`` times the budget, an intermediate (``--hierarchies``, default ``"self:int4"``,
  the same object as above) scores all of it in one forward, and the target verifies the budget's best nodes.

``self:int4`` runs at ``--int4-budgets``, the layer self-drafts at ``--layer-draft-budgets`` (each of their draft
forwards streams layers from disk, so fewer of them). Each method learns in its own ``LearntState`` per decoding mode,
kept across its prompts (as one user running only that method), and gets one warm-up call first. Per method and
mode: tokens/s over all prompts, tokens per target forward (calls of the target's decoder stack; a layer
self-draft's forwards run the same layers but not that stack, so they are not counted), SpecExec's draft seconds per
step; greedy outputs are checked against plain greedy (the run exits 1 if one differs). Sampled outputs are draws:
their distribution is the property tests' (``tests/test_sampling.py``, ``tests/test_sequoia.py``), not this run's.

Not a test: the figures depend on the disk, the CPU and the load. ``--quick --no-cap`` runs every method small (one
prompt, a few tokens) as a smoke check, without root. ``--context-tokens N`` puts each prompt after a document of N+
tokens, for long-prompt runs (see ``results/related_systems/README.md``).
Run (root): flock /tmp/bench.lock .venv/bin/python -m benchmarks.related_systems
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from pathlib import Path
from typing import Any

import torch

import specexec_hf
from specexec_hf.hf.intermediate_draft import HIERARCHY_DRAFT_FACTOR
from specexec_hf.hf.learnt_state import LearntState
from specexec_hf.models import resolve_draft, target_cache_dir
from specexec_hf.offload import layer_streamer
from specexec_hf.tools.prompts import chat_inputs, load_prompts

from benchmarks.memory_cap import MemoryCap, evict
from benchmarks.report import write_report
from benchmarks.ssd import (
    CACHE_FRACTION,
    DEFAULT_PREFETCH,
    cap_figures,
    capped_run,
    prefetch_value,
    streamed_target,
    summarize,
)
from benchmarks.timing import timed_generate

RESULTS = Path(__file__).resolve().parent / "results" / "related_systems"
PLAIN = "plain generate"
MODES = {"greedy": {}, "t=0.6": {"do_sample": True, "temperature": 0.6}}
"""Decoding modes: ``generate()`` keyword arguments beside each method's."""


def methods(
    draft: torch.nn.Module, int4: torch.nn.Module, layer_drafts: dict[str, torch.nn.Module], args,
    intermediates: dict[str, torch.nn.Module] | None = None,
) -> dict[str, dict[str, Any]]:
    """``generate()`` keyword arguments of each method compared, by label, in the table's order.

    Args:
        draft: The shipped draft.
        int4: The ``"self:int4"`` draft, built from the target in memory.
        layer_drafts: The layer self-drafts, built over the streamed target, by name.
        args: ``budgets`` (shipped draft: SpecExec and Sequoia), ``int4_budgets``, ``layer_draft_budgets`` and
            ``hierarchy_budgets``.
        intermediates: The hierarchies' intermediate models (TriForce: the shipped draft's tree re-ranked by one of
            them and cut to the budget), by name.
    """
    speculative = {"speculator": "specexec"}
    compared: dict[str, dict[str, Any]] = {PLAIN: {}}
    drafts = [("shipped draft", draft, args.budgets), ("self:int4", int4, args.int4_budgets)]
    drafts += [(name, layer_draft, args.layer_draft_budgets) for name, layer_draft in layer_drafts.items()]
    for name, assistant, budgets in drafts:
        for budget in budgets:
            compared[f"SpecExec, {name}, budget {budget}"] = {**speculative, "assistant_model": assistant,
                                                              "budget": budget}
    for budget in args.budgets if args.sequoia_budgets is None else args.sequoia_budgets:
        compared[f"Sequoia online, shipped draft, budget {budget}"] = {
            **speculative, "assistant_model": draft, "budget": budget, "tree_search": "sequoia"}
    for name, intermediate in (intermediates or {}).items():
        for budget in args.hierarchy_budgets:
            compared[f"hierarchy, shipped draft -> {name}, budget {budget}"] = {
                **speculative, "assistant_model": draft, "budget": budget, "intermediate_model": intermediate}
    return compared


def with_context(tokenizer: Any, prompt: str, tokens: int) -> str:
    """``prompt`` after a document of at least ``tokens`` tokens (the training prompts, in order, as numbered notes),
    for long-prompt runs; ``prompt`` itself when ``tokens`` is 0."""
    if tokens <= 0:
        return prompt
    notes: list[str] = []
    length = 0
    for number, note in enumerate(load_prompts("train"), start=1):
        notes.append(f"{number}. {note}")
        length += len(tokenizer(notes[-1] + "\n")["input_ids"])
        if length >= tokens:
            return "Here are some notes.\n\n" + "\n".join(notes) + f"\n\nSet the notes aside and answer this: {prompt}"
    raise ValueError(f"The training prompts hold {length} tokens, fewer than --context-tokens {tokens}.")


def drafts_in_memory() -> tuple[torch.nn.Module, torch.nn.Module, Any]:
    """The shipped draft, ``"self:int4"`` (built from the default target in memory, which is then freed) and the
    tokenizer."""
    target, draft, tokenizer = specexec_hf.load_default_pair()
    int4 = resolve_draft(target, "self:int4")
    del target
    gc.collect()
    return draft, int4, tokenizer


def working_bytes(cap: MemoryCap | None, drafts: list[torch.nn.Module], tokens: int) -> int:
    """The most memory one forward of any of ``drafts`` over ``tokens`` tokens takes beyond what the process holds
    (its transients: optimum-quanto's CPU kernels dequantize ``self:int4``'s weights on every forward), from the
    group's peak; 0 without a cap.

    Args:
        cap: The process's memory group, joined, with no limit yet.
        drafts: The drafts held in memory.
        tokens: Tokens per forward (the longest prompt plus the largest tree: the draft's first forward).
    """
    if cap is None:
        return 0
    ids = torch.zeros(1, tokens, dtype=torch.long)
    peaks = []
    for draft in drafts:
        gc.collect()
        cap.limit(None)  # no limit; restarts the peak
        base = cap.usage()
        with torch.no_grad():
            draft(input_ids=ids)
        peaks.append(cap.peak() - base)
    return max(peaks)


def measure(args, cap: MemoryCap | None, report: dict[str, Any]) -> dict[str, Any]:
    """Every method and mode on the same prompts, target streamed from disk under the cap; the entry is saved into
    ``report`` after each prompt, so a run cut short keeps whole prompts."""
    draft, int4, tokenizer = drafts_in_memory()
    checkpoint = target_cache_dir()
    weights = checkpoint / "model.safetensors"
    prompts = [chat_inputs(tokenizer, with_context(tokenizer, prompt, args.context_tokens))
               for prompt in load_prompts("eval")[: args.prompts]]
    entry: dict[str, Any] = {"prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "modes": MODES,
                             "prompt_tokens": [inputs["input_ids"].shape[1] for inputs in prompts]}
    report["measured"] = entry
    drafted = [*args.budgets, *args.int4_budgets, *(HIERARCHY_DRAFT_FACTOR * b for b in args.hierarchy_budgets)]
    longest = max(inputs["input_ids"].shape[1] for inputs in prompts) + max(drafted) + 1
    working = working_bytes(cap, [draft, int4], longest)
    evict(weights)  # the in-memory target's reads: uncharged before the cap is set
    with streamed_target(checkpoint, cap, args.prefetch, args.cache_fraction) as (model, capped_entry):
        streamer = layer_streamer(model)
        entry.update(capped_entry, ring_bytes=streamer.buffer_bytes, prefetch=streamer.prefetch,
                     sampling_defaults={key: getattr(model.generation_config, key) for key in ("top_k", "top_p")})
        if cap is not None:
            # The ring was sized under ssd.py's cap; the drafts' working memory and the slack come on top of it, or
            # self:int4's forwards would not fit in what that cap leaves once the ring is allocated. The weights are
            # read with O_DIRECT, so the larger cap caches none of them.
            slack = int(args.slack_mb * 1e6)
            entry.update(ring_sized_under_bytes=entry["limit_bytes"], draft_working_bytes=working, slack_bytes=slack,
                         limit_bytes=entry["limit_bytes"] + working + slack)
            entry["weights_over_limit"] = entry["weights_bytes"] / entry["limit_bytes"]
            cap.limit(entry["limit_bytes"])
        layer_drafts = {name: resolve_draft(model, name) for name in args.layer_drafts}
        intermediates = {name: int4 if name == "self:int4" else resolve_draft(model, name)
                         for name in args.hierarchies}
        compared = methods(draft, int4, layer_drafts, args, intermediates)
        entry["methods_compared"] = {label: {key: value for key, value in kwargs.items()
                                             if key not in ("assistant_model", "intermediate_model")}
                                     for label, kwargs in compared.items()}
        for kwargs in compared.values():  # warm-ups (lazy initialisations), learning in the draft's own state
            model.generate(**prompts[0], max_new_tokens=4, do_sample=False, **kwargs)
        evict(weights)
        # One state per method and mode, kept across the prompts: each method learns as if it ran alone.
        states = {(label, mode): {"learnt_state": LearntState()} if kwargs.get("speculator") else {}
                  for label, kwargs in compared.items() for mode in MODES}
        rows: list[dict[str, Any]] = []
        for index, inputs in enumerate(prompts):
            for mode, sampling in MODES.items():
                reference = None
                for label, kwargs in compared.items():
                    torch.manual_seed(args.seed + index)
                    row = {"prompt": index, "mode": mode, "method": label,
                           **timed_generate(model, inputs, args.max_new_tokens,
                                            **kwargs, **sampling, **states[label, mode])}
                    if sampling:
                        row["equals_plain_greedy"] = None  # a draw: its distribution is the property tests'
                    else:
                        reference = reference or row["tokens"]
                        row["equals_plain_greedy"] = row["tokens"] == reference
                    rows.append(row)
                    print(f"  prompt {index} {mode:<6} {label:<44} {len(row['tokens']) / row['seconds']:6.2f} tok/s"
                          f"{'  DIFFERS' if row['equals_plain_greedy'] is False else ''}", flush=True)
            entry["rows"] = rows
            entry["summary"] = summaries(rows)
            cap_figures(cap, entry)
            save(report, args.out)
    return entry


def summaries(rows: list[dict[str, Any]]) -> dict[str, dict[str, dict]]:
    """Per mode, :func:`ssd.summarize`'s figures per method plus its tokens/s over plain ``generate()``'s; sampled
    modes have no identity with plain greedy to report."""
    by_mode: dict[str, dict[str, dict]] = {}
    for mode in dict.fromkeys(row["mode"] for row in rows):
        summary = summarize([row for row in rows if row["mode"] == mode])
        plain = summary[PLAIN]["tokens_per_second"]
        for figures in summary.values():
            figures["speedup_vs_plain"] = figures["tokens_per_second"] / plain
            if mode != "greedy":
                del figures["all_equal_plain_greedy"]
        by_mode[mode] = summary
    return by_mode


def markdown(report: dict[str, Any]) -> str:
    """The table: a row per method, greedy and sampled figures side by side."""
    environment = report["environment"]
    entry = report.get("measured") or {}
    lines = [f"Command: `{environment['command']}`", "",
             f"Machine: {environment['machine']}, torch {environment['torch']}, transformers "
             f"{environment['transformers']}, {environment['threads']} threads; memory cap: {environment['cap']}; "
             f"load average {environment['load_before']} before, {environment.get('load_after', '?')} after; "
             f"{environment.get('minutes', '?')} minutes."]
    if entry.get("capped"):
        lines.append(f"Cap: {entry['limit_bytes'] / 1e6:.0f} MB: the process's {entry['usage_before_bytes'] / 1e6:.0f}"
                     f" MB before the target loaded, plus {environment['cache_fraction']:.2f} of its "
                     f"{entry['weights_bytes'] / 1e6:.0f} MB of "
                     f"weights ({entry['ring_sized_under_bytes'] / 1e6:.0f} MB, ssd.py's cap, under which the ring "
                     f"was sized: {entry['ring_bytes'] / 1e6:.0f} MB, prefetch {entry['prefetch']}), plus the drafts' "
                     f"measured working memory ({entry['draft_working_bytes'] / 1e6:.0f} MB) and "
                     f"{entry['slack_bytes'] / 1e6:.0f} MB of slack, both added once the target was loaded; peak "
                     f"charged {entry.get('peak_bytes', 0) / 1e6:.0f} MB.")
    elif "ring_bytes" in entry:
        lines.append(f"No cap: ring {entry['ring_bytes'] / 1e6:.0f} MB (prefetch {entry['prefetch']}).")
    summary = entry.get("summary")
    if not summary:
        return "\n".join([*lines, "", "(nothing measured yet)"]) + "\n"
    done = len({row["prompt"] for row in entry["rows"]})
    prompt_tokens = ", ".join(map(str, entry.get("prompt_tokens", [])))
    lines += ["", f"{done} of {entry['prompts']} held-out prompts ({prompt_tokens} "
              f"tokens) x {entry['max_new_tokens']} new tokens; greedy and "
              f"temperature 0.6 (the model's other sampling settings: {entry.get('sampling_defaults')}); every weight "
              "of the target streamed from disk for every forward.", ""]
    modes = list(summary)
    header = ["method"]
    for mode in modes:
        header += [f"{mode} tok/s", f"{mode} vs plain", f"{mode} tokens / target fwd"]
        header += ["greedy draft s / step", "greedy identical to plain"] if mode == "greedy" else []
    lines += ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    for label in summary[modes[0]]:
        cells = [label]
        for mode in modes:
            figures = summary[mode][label]
            cells += [f"{figures['tokens_per_second']:.2f}", f"{figures['speedup_vs_plain']:.2f}x",
                      f"{figures['tokens_per_target_forward']:.2f}"]
            if mode == "greedy":
                draft_seconds = figures.get("draft_seconds_per_step")
                cells += ["" if draft_seconds is None else f"{draft_seconds:.2f}",
                          "yes" if figures["all_equal_plain_greedy"] else "NO"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def save(report: dict[str, Any], out: Path) -> None:
    """Writes the JSON and the Markdown table of what the report has so far."""
    write_report(out, "related_systems", report, markdown(report), indent=1)


# --quick: every method, small (one prompt, a few tokens, a cheap layer self-draft): a smoke check. Prefetch 1: without
# a cap, "auto" would hold every weight in the ring and stream nothing.
QUICK = {"prompts": 1, "max_new_tokens": 4, "budgets": [8], "int4_budgets": [8], "layer_draft_budgets": [8],
         "layer_drafts": ["self:exit:2"], "hierarchy_budgets": [4], "prefetch": 1}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line; ``--quick`` swaps in :data:`QUICK`'s defaults (options given still win)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="every method, small: a smoke check")
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=24)
    parser.add_argument("--budgets", type=int, nargs="+", default=[16, 64],
                        help="SpecExec's and Sequoia's budgets with the shipped draft")
    parser.add_argument("--int4-budgets", type=int, nargs="*", default=[16], help="self:int4's budgets")
    parser.add_argument("--sequoia-budgets", type=int, nargs="*", default=None,
                        help="Sequoia online's budgets (default: --budgets)")
    parser.add_argument("--layer-draft-budgets", type=int, nargs="+", default=[16],
                        help="the layer self-drafts' budgets")
    parser.add_argument("--layer-drafts", nargs="*", default=["self:skip:10-20"],
                        help="layer self-drafts ('self:exit:K', 'self:skip:<layers>') beside self:int4")
    parser.add_argument("--hierarchies", nargs="*", default=["self:int4"],
                        help="intermediate models of TriForce-style hierarchies over the shipped draft ('self:int4', "
                             "'self:exit:K', ...): its tree of 4x the budget re-ranked by them and cut to the budget")
    parser.add_argument("--hierarchy-budgets", type=int, nargs="+", default=[16], help="the hierarchies' budgets")
    parser.add_argument("--context-tokens", type=int, default=0,
                        help="long prompts: each prompt after a document of at least this many tokens")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed of prompt i: seed + i, for every method")
    parser.add_argument("--cache-fraction", type=float, default=CACHE_FRACTION,
                        help="memory above the process's own before loading (ring, activations, page cache), as a "
                             "share of the weights (ssd.py's)")
    parser.add_argument("--prefetch", type=prefetch_value, default=DEFAULT_PREFETCH,
                        help="units read ahead by the stream executor: a positive integer or 'auto'")
    parser.add_argument("--slack-mb", type=float, default=512,
                        help="added to the cap with the drafts' working memory once the ring is sized (tree forwards' "
                             "activations, allocator growth: ssd.py's cap alone was OOM-killed at budget 64)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--no-cap", action="store_true", help="run without a memory cgroup (figures say so)")
    quick = argparse.ArgumentParser(add_help=False)
    quick.add_argument("--quick", action="store_true")
    if quick.parse_known_args(argv)[0].quick:
        parser.set_defaults(**QUICK)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cap, environment = capped_run(args, "related_systems.py", argv)
    report: dict[str, Any] = {"environment": environment}
    started = time.perf_counter()
    try:
        measure(args, cap, report)
    finally:
        if cap is not None:
            cap.leave()
        report["environment"]["load_after"] = [round(x, 2) for x in os.getloadavg()]
        report["environment"]["minutes"] = round((time.perf_counter() - started) / 60, 1)
        save(report, args.out)
    print(markdown(report), flush=True)
    greedy = report["measured"]["summary"]["greedy"]
    differs = [label for label, figures in greedy.items() if not figures["all_equal_plain_greedy"]]
    if differs:
        print(f"outputs differ from plain greedy: {differs}", flush=True)
    return 1 if differs else 0


if __name__ == "__main__":
    raise SystemExit(main())
