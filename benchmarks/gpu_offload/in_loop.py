"""Section ``in_loop``: the GPU headline measured in one loop (issue #56, item 4), not composed from parts.

Every cost is paid in the same loop. A big random-weight target (Llama-3-8B-shaped, bf16; and Llama-3-70B-shaped
with int4 layers and few of its layers, when optimum-quanto is present) is streamed from pinned RAM by the library's
device executor, placed as the forward section places it (:func:`placement.placed_target`, ``stream``). The real
default pair (SmolLM2-135M-Instruct and its shipped draft) runs ``generate()`` on real held-out prompts:

- **SpecExec**: the real draft grows its real tree at every step; the big target verifies exactly that tree in one
  forward (:class:`~specexec_hf.hf.tree_scorer.TreeScorer`: the pending committed tokens, then the tree's nodes under
  a 4-D ancestor mask, each node at its parent's position plus one), its head applied to the nodes the walk visits,
  and its KV cache keeps the accepted path.
- **HF assisted**: transformers' assisted loop with the same draft; the big target verifies each drafted chain in one
  forward the same way.
- **Plain**: the big target's own greedy ``generate()``, one token per forward.

What is replayed: the big target has random weights, so its own choices would accept nothing. Each step's accepted
path is the real pair's: the real small target verifies the same tree (or chain) and its acceptance walk decides
what is committed; the big target keeps that path in its cache. The small target's forwards are timed apart (by CUDA
events on a GPU) and taken out of the loop's time: tokens/s counts the draft's work, the big target's forwards and
the host's, not the small target's. Token ids are the pair's tokenizer's, mapped into the big target's vocabulary by
``id % vocab`` (the identity for SmolLM2's 49152 ids under Llama-3's 128256): a random target's cost does not
depend on which ids it reads.

Figures are checked before they are written (``figure_checks``); a failing one is withheld and fails the section.
"""

from __future__ import annotations

import statistics
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from transformers.generation.candidate_generator import AssistedCandidateGenerator

from specexec_hf.core.tree import TokenTree
from specexec_hf.hf.decoder import SpecExecDecoder
from specexec_hf.hf.request import Request
from specexec_hf.hf.tree_scorer import TreeScorer
from specexec_hf.offload import layer_streamer

from benchmarks.figure_checks import FigureAudit, FigureError, Noise, parts_within, positive, ratio
from benchmarks.gpu_offload.end_to_end import RealPair
from benchmarks.gpu_offload.forward import decoder_layer_bytes, full_shape_streamed_bytes
from benchmarks.gpu_offload.placement import collect, placed_target, release
from benchmarks.gpu_offload.projection import PUBLISHED
from benchmarks.report import Goal, table
from benchmarks.shapes import GB, LlamaShape, random_llama
from benchmarks.timing import Deadline, synchronize, timed_generate

PCIE4_X16_GBPS = 25.0  # a PCIe 4.0 x16 link's usable host-to-device rate, the consumer GPU's (RTX 4090's) link
IDEAL_SHARE_GOAL = 0.85
GOAL_OVER = {"plain streamed": ("plain", 5.0), "HF assisted": ("assisted", 2.0)}  # SpecExec over each, 8B bf16
SECTION = "in loop"
# Seconds a big target needs left to be built, placed and run one method: on the CPU stand-in, on a GPU (the 8B bf16
# target: 16 GB of random weights written, then pinned).
BUILD_SECONDS = (5.0, 60.0)


@dataclass
class BigTarget:
    """A big random target as the loop streams it.

    Args:
        label: The shape and weights, e.g. ``"Llama-3-8B bf16, 32 of 32 layers"``.
        model: The placed model (stream executor).
        bytes_per_forward: Bytes one forward streams over the link (every streamed unit, as stored).
        full_shape_bytes_per_forward: The same for the whole shape (more layers than were built).
        headline: Whether the SpecExec ratio goals are its (the 8B bf16 target) or the ideal-share goal (int4).
    """

    label: str
    model: torch.nn.Module
    bytes_per_forward: int
    full_shape_bytes_per_forward: int
    headline: bool


# The arithmetic, on given numbers (tested on the CPU).


def loop_tokens_per_second(new_tokens: int, wall_seconds: float, replayed_seconds: float) -> float:
    """Tokens/s of the loop: ``new_tokens`` over the wall time less the real small target's forwards (the replay's
    oracle, not a cost of the method); :class:`FigureError` if the parts cannot be right."""
    positive("new tokens", new_tokens)
    left = parts_within("loop seconds", wall_seconds, {"the small target's forwards": replayed_seconds}, Noise())
    return positive("loop tokens/s", new_tokens / positive("loop seconds less the small target's", left))


def ideal_tokens_per_second(tokens_per_forward: float, link_gbps: float, bytes_per_forward: float) -> float:
    """Tokens/s of a loop bound by the link alone: tokens per target forward x link bytes/s / bytes per forward."""
    return (positive("tokens per forward", tokens_per_forward) * positive("link GB/s", link_gbps) * GB
            / positive("bytes per forward", bytes_per_forward))


def share_of_ideal(measured: float, ideal: float, noise: Noise) -> float:
    """``measured / ideal``; above ``noise.over_bound`` it cannot be right (the bytes or the seconds are wrong)."""
    share = ratio("tokens/s as a share of the ideal", measured, ideal)
    if share > noise.over_bound:
        raise FigureError("tokens/s as a share of the ideal", f"{share:.3g} is above {noise.over_bound:g}x the "
                          "link-bound ideal: the bytes or the seconds are wrong")
    return share


def at_link(share: float, tokens_per_forward: float, link_gbps: float, bytes_per_forward: float) -> float:
    """Tokens/s of a loop reaching ``share`` of its ideal over a link of ``link_gbps`` (the full shape's bytes)."""
    return share * ideal_tokens_per_second(tokens_per_forward, link_gbps, bytes_per_forward)


def tokens_per_forward_needed(
    tokens_per_second: float, share: float, link_gbps: float, bytes_per_forward: float
) -> float:
    """Tokens per target forward a loop at ``share`` of its ideal needs to reach ``tokens_per_second``."""
    return tokens_per_second / at_link(share, 1.0, link_gbps, bytes_per_forward)


# The loop.


def plain_request(prompt: torch.Tensor) -> Request:
    """The request of an unpadded ``[1, L]`` prompt, every token attended, positions 0..L-1."""
    length = prompt.shape[1]
    return Request(prompt, prompt[:, :0], {}, torch.ones(length, dtype=torch.bool), torch.arange(length))


def chain_tree(root: torch.Tensor, chain: torch.Tensor) -> TokenTree:
    """The tree of a drafted chain: ``root`` (a token) then each of ``chain``'s tokens under the one before."""
    tree = TokenTree.from_root(int(root), device=chain.device)
    for position, token in enumerate(chain):
        tree.add_children(torch.tensor([position], device=chain.device), token[None], torch.zeros(1))
    return tree


class BigVerifier:
    """The big target verifying, in one forward each, the trees the real pair verifies, keeping the pair's paths.

    Args:
        model: The big target.
        prompt: The ``[1, L]`` prompt in the pair's ids.
        device: Where ``model`` computes (its forwards are timed to the device's end).
    """

    def __init__(self, model: torch.nn.Module, prompt: torch.Tensor, device: torch.device):
        self.vocab = model.config.vocab_size
        self.scorer = TreeScorer(model, plain_request(prompt.to(device) % self.vocab))
        self.device = device
        self.forwards = 0
        self.seconds = 0.0

    def verify(self, sequence: torch.Tensor, tree: TokenTree, length: int, path: list[int]) -> None:
        """One forward of the pending committed tokens of ``sequence`` and ``tree`` (ids mapped by ``% vocab``),
        the head applied to the nodes the walk visited (the root and ``path``), then ``path`` kept."""
        synchronize(self.device)
        started = time.perf_counter()
        logits = self.scorer.score(sequence % self.vocab, replace(tree, tokens=tree.tokens % self.vocab))
        for node in (0, *path):
            logits.row(node).argmax()
        self.scorer.keep(length, path)
        synchronize(self.device)
        self.seconds += time.perf_counter() - started
        self.forwards += 1


@contextmanager
def verified_by(big: BigVerifier) -> Iterator[None]:
    """While open, every SpecExec step and every HF assisted step of the pair is verified by ``big`` too, after the
    pair's own walk, which decides the path kept."""
    original_step = SpecExecDecoder.step
    original_candidates = AssistedCandidateGenerator.get_candidates
    original_update = AssistedCandidateGenerator.update_candidate_strategy
    drafted: list[tuple[torch.Tensor, torch.Tensor]] = []

    def step(decoder: SpecExecDecoder, sequence: torch.Tensor) -> Any:
        outcome = original_step(decoder, sequence)
        big.verify(sequence, outcome.grown.tree, outcome.length, outcome.acceptance.path)
        return outcome

    def get_candidates(generator: AssistedCandidateGenerator, input_ids: torch.Tensor, *args: Any, **kwargs: Any):
        candidates = original_candidates(generator, input_ids, *args, **kwargs)
        drafted.append((input_ids, candidates[0][0, input_ids.shape[1] :]))
        return candidates

    def update(generator: AssistedCandidateGenerator, input_ids: torch.Tensor, scores: Any, num_matches: int):
        before, chain = drafted.pop()
        big.verify(before, chain_tree(before[0, -1], chain), before.shape[1], list(range(1, num_matches + 1)))
        return original_update(generator, input_ids, scores, num_matches)

    with (mock.patch.object(SpecExecDecoder, "step", step),
          mock.patch.object(AssistedCandidateGenerator, "get_candidates", get_candidates),
          mock.patch.object(AssistedCandidateGenerator, "update_candidate_strategy", update)):
        yield


def methods(pair: RealPair, budgets: list[int], headline: bool) -> dict[str, dict[str, Any]]:
    """The loop's methods as ``generate()`` keywords of the pair (empty: plain, the big target alone), in the order
    they run, the goals' first: SpecExec at the first budget, then (for the headline target only, whose goals
    compare them) HF assisted and plain, then SpecExec at the other budgets."""
    specexec = {f"SpecExec budget {budget}": {"assistant_model": pair.draft, "speculator": "specexec", "budget": budget}
                for budget in budgets}
    first = dict(list(specexec.items())[:1])
    if headline:
        first.update({"HF assisted": {"assistant_model": pair.draft}, "plain streamed": {}})
    return {**first, **specexec}


def run_method(
    big: BigTarget, pair: RealPair, kwargs: dict[str, Any], prompt: dict[str, torch.Tensor], max_new_tokens: int,
    device: torch.device,
) -> dict[str, Any]:
    """One prompt of one method: its new tokens, the loop's seconds and their parts."""
    if not kwargs:  # plain: the big target's own greedy decoding, every token its own
        mapped = {"input_ids": prompt["input_ids"] % big.model.config.vocab_size,
                  "attention_mask": prompt["attention_mask"]}
        row = timed_generate(big.model, mapped, max_new_tokens, device, min_new_tokens=max_new_tokens)
        return {"new_tokens": len(row["tokens"]), "seconds": row["seconds"], "small_target_seconds": 0.0,
                "big_target_seconds": row["target_seconds"], "big_target_forwards": row["target_forwards"]}
    verifier = BigVerifier(big.model, prompt["input_ids"], device)
    with verified_by(verifier):
        row = timed_generate(pair.reference, prompt, max_new_tokens, device, **kwargs)
    return {"new_tokens": len(row["tokens"]), "seconds": row["seconds"], "small_target_seconds": row["target_seconds"],
            "big_target_seconds": verifier.seconds, "big_target_forwards": verifier.forwards,
            "draft_seconds": row["draft_seconds"]}


def method_figures(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One method's figures over its prompts: the median prompt's loop tokens/s (``median_low``: one prompt's own
    figure) and its parts; tokens per big-target forward over all prompts."""
    rates = [loop_tokens_per_second(row["new_tokens"], row["seconds"], row["small_target_seconds"]) for row in rows]
    middle = rates.index(statistics.median_low(rates))
    forwards = sum(row["big_target_forwards"] for row in rows)
    return {"status": "measured", "tokens_per_second": rates[middle], "tokens_per_second_per_prompt": rates,
            "tokens_per_forward": ratio("tokens per big-target forward", sum(r["new_tokens"] for r in rows), forwards),
            "median_prompt": rows[middle]}


def measure_target(
    big: BigTarget, pair: RealPair, budgets: list[int], max_new_tokens: int, device: torch.device, deadline: Deadline,
) -> dict[str, Any]:
    """Every method on ``big``: a full-length untimed warm-up (the first prompt), then each prompt timed while the
    time left holds them at the warm-up's pace."""
    entry: dict[str, Any] = {"bytes_per_forward": big.bytes_per_forward,
                             "full_shape_bytes_per_forward": big.full_shape_bytes_per_forward, "methods": {}}
    for name, kwargs in methods(pair, budgets, big.headline).items():
        if not deadline.allows(10):
            entry["methods"][name] = {"status": "skipped: time budget spent"}
            continue
        warm_up = run_method(big, pair, kwargs, pair.prompts[0], max_new_tokens, device)
        if not deadline.allows(1.5 * len(pair.prompts) * warm_up["seconds"]):
            entry["methods"][name] = {"status": f"skipped: {len(pair.prompts)} prompts at the warm-up's pace "
                                                f"({warm_up['seconds']:.0f} s each) do not fit the time left"}
            continue
        rows = [run_method(big, pair, kwargs, prompt, max_new_tokens, device) for prompt in pair.prompts]
        try:
            entry["methods"][name] = method_figures(rows)
        except FigureError as error:
            entry["methods"][name] = {"status": f"FAILED: {error}", "withheld": rows}
            raise
        print(f"  in loop, {big.label}, {name}: {entry['methods'][name]['tokens_per_second']:.2f} tok/s, "
              f"{entry['methods'][name]['tokens_per_forward']:.2f} tokens per forward", flush=True)
    return entry


def best_specexec(entry: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    rows = {name: row for name, row in entry["methods"].items()
            if name.startswith("SpecExec") and row.get("status") == "measured"}
    return max(rows.items(), key=lambda item: item[1]["tokens_per_second"]) if rows else None


def headline_goals(entry: dict[str, Any]) -> list[Goal]:
    """SpecExec (its best budget) over plain streamed decoding and HF assisted, measured in the loop."""
    best = best_specexec(entry)
    goals = []
    for method, (key, bound) in GOAL_OVER.items():
        other = entry["methods"].get(method, {})
        if best is not None and other.get("status") == "measured":
            claim = f"in one loop: {best[0]} / {method}"
            goals.append(Goal(f"in_loop_specexec_over_{key}", claim,
                              ratio(claim, best[1]["tokens_per_second"], other["tokens_per_second"]), bound))
    return goals


def ideal_figures(entry: dict[str, Any], link_gbps: float, noise: Noise) -> dict[str, Any] | None:
    """The best SpecExec row against its link-bound ideal, and the whole shape at this link and at PCIe 4.0 x16
    beside the published systems (each with the tokens per forward it rests on)."""
    best = best_specexec(entry)
    if best is None:
        return None
    name, row = best
    tokens_per_forward = row["tokens_per_forward"]
    ideal = ideal_tokens_per_second(tokens_per_forward, link_gbps, entry["bytes_per_forward"])
    share = share_of_ideal(row["tokens_per_second"], ideal, noise)
    full = entry["full_shape_bytes_per_forward"]
    published = [{"system": source["system"], "tokens_per_second": max(source["tokens_per_second"]),
                  "tokens_per_forward_needed_at_pcie4": tokens_per_forward_needed(
                      max(source["tokens_per_second"]), share, PCIE4_X16_GBPS, full)}
                 for source in PUBLISHED if source["weights"].startswith("4-bit")]
    return {"method": name, "tokens_per_forward": tokens_per_forward, "link_gbps": link_gbps,
            "ideal_tokens_per_second": ideal, "share_of_ideal": share,
            "full_shape_tokens_per_second": at_link(share, tokens_per_forward, link_gbps, full),
            "full_shape_tokens_per_second_pcie4": at_link(share, tokens_per_forward, PCIE4_X16_GBPS, full),
            "published": published}


def big_targets(
    shapes: list[tuple[LlamaShape, int, str | None]], device: torch.device, offload_dir: Path,
    deadline: Deadline | None = None,
) -> Iterator[BigTarget | str]:
    """Each ``(shape, layers, weights)`` built and placed in turn (freed when the next is asked for); a note
    instead where it cannot be (int4 without optimum-quanto) or where ``deadline`` leaves too little time to build
    it and run a method (:data:`BUILD_SECONDS`): a section killed at its limit would lose every target's figures."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for shape, layers, weights in shapes:
        label = f"{shape.name} {str(dtype).removeprefix('torch.') if weights is None else weights}, {layers} of " \
                f"{shape.layers} layers"
        if deadline is not None and not deadline.allows(BUILD_SECONDS[device.type == "cuda"]):
            yield f"{label}: not run: the time budget has {deadline.left():.0f} s left"
            continue
        built = random_llama(shape, layers, dtype)
        try:
            model = placed_target("stream", built, device, offload_dir, weights)
        except ImportError as error:
            yield f"{label}: not run: {error}"
            continue
        streamed = layer_streamer(model).streamed_bytes_per_forward
        built_as = {"shape": {"layers": shape.layers}, "layers_built": layers,
                    "layer_bytes": decoder_layer_bytes(built, weights)}
        full = full_shape_streamed_bytes({"streamed_bytes": streamed}, built_as)
        del built
        try:
            yield BigTarget(label, model, streamed, full, headline=weights is None)
        finally:
            release(model)
            del model
            collect(device)


def in_loop(
    pair: RealPair, shapes: list[tuple[LlamaShape, int, str | None]], budgets: list[int], max_new_tokens: int,
    link_gbps: float, device: torch.device, deadline: Deadline, offload_dir: Path, audit: FigureAudit,
) -> dict[str, Any]:
    """The section's figures (see the module docstring); a figure that fails its check is recorded in ``audit``
    and withheld (with what derives from it); a target whose run raised is recorded under ``errors``, and the next
    one still runs."""
    pair.reference.to(device)
    pair.draft.to(device)
    result: dict[str, Any] = {
        "pair": pair.name, "real_pair": pair.real, "prompts": len(pair.prompts), "max_new_tokens": max_new_tokens,
        "replayed": "each step's accepted path: the real small target's walk over the same tree or chain; its "
                    "forwards are timed apart and not counted in tokens/s",
        "ids": "the pair's token ids mapped into the big target's vocabulary by id % vocab",
        "targets": {}, "notes": [], "errors": []}
    for big in big_targets(shapes, device, offload_dir, deadline):
        if isinstance(big, str):
            result["notes"].append(big)
            continue
        try:
            result["targets"][big.label] = target_figures(big, pair, budgets, max_new_tokens, link_gbps, device,
                                                          deadline, audit)
        except Exception as error:  # recorded, so that one target failing does not lose the next one's figures
            result["targets"][big.label] = {"status": f"error: {type(error).__name__}: {error}"}
            result["errors"].append({"section": SECTION, "traceback": traceback.format_exc()})
            collect(device)
    return result


def target_figures(
    big: BigTarget, pair: RealPair, budgets: list[int], max_new_tokens: int, link_gbps: float, device: torch.device,
    deadline: Deadline, audit: FigureAudit,
) -> dict[str, Any]:
    """One big target's methods and then its goals: SpecExec's ratios for the headline target, its share of the
    link-bound ideal for the others."""
    entry: dict[str, Any] = {}
    if not audit.passes(SECTION, lambda: entry.update(
            measure_target(big, pair, budgets, max_new_tokens, device, deadline))):
        entry["status"] = "FAILED: a figure failed its check"
        return entry
    entry["status"] = "measured"
    if big.headline:
        audit.passes(SECTION, lambda: entry.update(goals=[goal.as_json() for goal in headline_goals(entry)]))
    elif audit.passes(SECTION, lambda: entry.update(ideal=ideal_figures(entry, link_gbps, audit.noise))):
        if entry["ideal"] is not None:
            entry["goals"] = [Goal("in_loop_int4_share_of_ideal", f"in one loop: {big.label}, "
                                   f"{entry['ideal']['method']}: tokens/s / its link-bound ideal",
                                   entry["ideal"]["share_of_ideal"], IDEAL_SHARE_GOAL).as_json()]
    return entry


def in_loop_markdown(result: dict[str, Any] | None) -> list[str]:
    """The section's tables and goals as Markdown lines (none without the section)."""
    if not result:
        return []
    lines = [f"## In one loop: {result['pair']} trees verified by big streamed targets", "",
             f"Replayed: {result['replayed']}; {result['ids']}. {result['prompts']} prompts, "
             f"{result['max_new_tokens']} new tokens; tokens/s of the median prompt.", ""]
    for label, entry in result["targets"].items():
        rows = [(name, f"{row['tokens_per_second']:.2f}", f"{row['tokens_per_forward']:.2f}",
                 f"{row['median_prompt']['big_target_seconds']:.2f}",
                 f"{row['median_prompt']['small_target_seconds']:.2f}") if row.get("status") == "measured"
                else (name, None, None, None, row.get("status")) for name, row in entry.get("methods", {}).items()]
        lines += [f"### {label}: {entry.get('status')}", ""]
        lines += table(["method", "tok/s", "tokens per forward", "big target s", "small target s (not counted)"],
                       rows, [False, True, True, True, True])
        ideal = entry.get("ideal")
        if ideal:
            lines += ["", f"{ideal['method']}: {ideal['share_of_ideal']:.0%} of its ideal "
                      f"({ideal['ideal_tokens_per_second']:.2f} tok/s at {ideal['tokens_per_forward']:.2f} tokens per "
                      f"forward, {ideal['link_gbps']:.1f} GB/s); the whole shape at this link "
                      f"{ideal['full_shape_tokens_per_second']:.2f} tok/s, at PCIe 4.0 x16 ({PCIE4_X16_GBPS:g} GB/s) "
                      f"{ideal['full_shape_tokens_per_second_pcie4']:.2f} tok/s.", ""]
            lines += table(["published", "tok/s", "tokens per forward this loop would need at PCIe 4.0 x16"],
                           [(row["system"], f"{row['tokens_per_second']:g}",
                             f"{row['tokens_per_forward_needed_at_pcie4']:.1f}") for row in ideal["published"]],
                           [False, True, True])
        lines += [""] + [Goal.from_json(goal).line() for goal in entry.get("goals", [])] + [""]
    return lines + [f"- {note}" for note in result["notes"]]
