"""``budget="auto"``: pick the tree size that maximises expected tokens per second on this hardware.

Sequoia's idea applied to dynamic trees. Two measurements model a step at budget ``B``:

- time: the target's forward time over ``B + 1`` tokens and the draft's over ``expand_per_forward`` tokens,
  measured once per model, placement, device, dtype and thread count (cached in-process and on disk), with the
  draft's forwards per tree and running corrections of both from observed steps. The target's correction is a
  per-budget offset, since what the cached profile cannot know is mostly a constant per forward: a disk slower
  or faster today than when it was timed, or reads that went on under the draft (on the default pair streamed from
  disk, the profile said 0.27 s at budget 64 and 0.32 s at 128; the steps took 0.37 s and 0.44 s one day, 0.46 s
  and 0.47 s on a slower one);
- tokens: the expected tokens per step, ``1 + (sum of the B best node values)`` under the running per-rank
  acceptance profile (how often the target's choice was the draft's rank-r child). Under that model the best
  tree of any size is its best nodes (see :class:`specexec_hf.core.static_trees.SequoiaSearch`), which is what
  SpecExec's best-first tree approximates. It overrates large trees (the real tree is ranked by the draft, not by
  the acceptance it will meet): on the default pair in memory the observed tokens per step were 0.94x the modelled
  ones at budget 8 and 0.71x at budget 256. So every walk also yields observed tokens for each candidate budget up
  to the one it was grown at (the walk cut where its path leaves the tree's best ``b`` nodes), which replace the
  model there (each budget compared with the one below on the walks that saw both, since larger budgets are seen
  on fewer walks, often other prompts'); larger budgets keep the model scaled by the largest observed budget's
  ratio.

Before every step the budget with the highest ``tokens / time`` among the candidates is used, except that every
``PROBE_EVERY``-th step runs the candidate below it, the next probe the one above: estimates move only where steps
run, so without probes a budget whose first few steps met a slow moment would keep its offset and never run
again (on the default pair streamed from disk, three early steps at budget 128 left it, and every smaller budget,
0.13 s slower than they were, and "auto" held budget 256 at 0.72x budget 128's tokens/s). For the same reason the
target's offsets weigh each new forward by ``RECENT_WEIGHT``: they follow the disk of the moment. After a
step the acceptance walk and the draft time update the running estimates.
"""

from __future__ import annotations

import json
import math
import os
import platform
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import PreTrainedModel

from ..core.batch_budget import highest_rate
from ..core.config import SpecExecConfig
from ..core.search import rank_nodes
from ..core.static_trees import best_first_nodes
from ..core.tree import TokenTree
from ..core.verify import Acceptance
from .cache_dir import cache_root
from .compat import execution_device
from .executor import executor_of
from .forward import Feed, model_logits, node_logits
from .kv import compact_cache, new_cache

DEFAULT_CANDIDATES = (8, 16, 32, 64, 128, 256, 512, 1024)
PROFILE_CONTEXT = 128  # tokens in the cache while timing, a typical prompt-plus-answer length
PROFILE_FILE_NAME = "forward_profiles.json"
MODEL_WEIGHT_STEPS = 2.0  # observed tokens at a budget outweigh the model there after this many steps
RECENT_WEIGHT = 0.5  # the weight of a new target forward in its budget's offset (see the module docstring)
PROBE_EVERY = 8  # every this many steps, a neighbour of the best budget runs once (see the module docstring)


@dataclass
class ForwardProfile:
    """Seconds per forward over ``n`` new tokens on top of a short cache, at measured token counts.

    Args:
        seconds: ``{token_count: seconds}``.
    """

    seconds: dict[int, float]

    def __post_init__(self) -> None:
        # A forward over more tokens takes no less time: a count timed slower than a larger one met noise (the disk
        # or another job slowed that run), so each count takes the least of its own and every larger count's time.
        # (A cached profile timed on the default pair streamed from disk read 0.38 s at 9 tokens, 0.29 s at 129.)
        self.seconds = dict(self.seconds)
        least = math.inf
        for size in sorted(self.seconds, reverse=True):
            least = self.seconds[size] = min(self.seconds[size], least)

    def __call__(self, tokens: int) -> float:
        """Forward time over ``tokens`` tokens, linear between (and beyond) the measured counts."""
        sizes = sorted(self.seconds)
        if tokens in self.seconds or len(sizes) == 1:
            return self.seconds.get(tokens, self.seconds[sizes[0]])
        lower = max([s for s in sizes if s < tokens], default=sizes[0])
        upper = min([s for s in sizes if s > tokens], default=sizes[-1])
        if lower == upper:  # outside the measured range: extend the nearest segment
            lower, upper = (sizes[0], sizes[1]) if tokens < sizes[0] else (sizes[-2], sizes[-1])
        slope = (self.seconds[upper] - self.seconds[lower]) / (upper - lower)
        return max(self.seconds[lower] + slope * (tokens - lower), 0.0)


@torch.no_grad()
def measure_forward_profile(
    model: PreTrainedModel, sizes: Sequence[int], repeats: int = 3, enough_seconds: float = 1.0
) -> ForwardProfile:
    """Times ``model``'s forward over each token count in ``sizes`` with a tree-style 4-D mask.

    Args:
        model: The model to time.
        sizes: Token counts per forward.
        repeats: Most timed forwards per count; the fastest is kept, since interference only adds time.
        enough_seconds: A count stops repeating once its runs took this long (slow forwards vary little).
    """
    device = execution_device(model)  # an offloaded embedding's weights are on the meta device
    vocab = model.config.vocab_size
    cache = new_cache()
    context = torch.arange(PROFILE_CONTEXT, device=device) % vocab
    model_logits(model, Feed(cache, context, torch.arange(PROFILE_CONTEXT, device=device), None, 1))
    seconds = {}
    for size in [min(sizes), *sorted(sizes)]:  # the first run warms up kernels and allocator
        tokens = torch.arange(size, device=device) % vocab
        positions = torch.arange(PROFILE_CONTEXT, PROFILE_CONTEXT + size, device=device)
        visible = torch.ones(size, PROFILE_CONTEXT + size, dtype=torch.bool, device=device).tril(PROFILE_CONTEXT)
        runs: list[float] = []
        while len(runs) < repeats and sum(runs) < enough_seconds:
            started = time.perf_counter()
            # As in a SpecExec step: the tree forward, then the logits of the nodes the walk visits (about one),
            # read on the host, which also waits for an accelerator's queued work.
            node_logits(model, Feed(cache, tokens, positions, visible, size)).row(0).argmax().item()
            runs.append(time.perf_counter() - started)
            compact_cache(cache, PROFILE_CONTEXT, torch.empty(0, dtype=torch.long))
        seconds[size] = min(runs)
    return ForwardProfile(seconds)


_profiles: dict[str, ForwardProfile] = {}


def _profile_key(model: PreTrainedModel, sizes: Sequence[int]) -> str:
    return "|".join(
        [
            str(getattr(model.config, "_name_or_path", "") or type(model).__name__),
            f"{sum(p.numel() for p in model.parameters())} params",
            str(model.get_input_embeddings().weight.dtype),
            str(execution_device(model)),
            _placement(model),
            f"{torch.get_num_threads()} threads",
            platform.machine(),
            platform.processor() or platform.node(),
            ",".join(map(str, sorted(sizes))),
        ]
    )


def _placement(model: PreTrainedModel) -> str:
    """Where the weights live and how many accelerate's hooks fetch per forward (those left on the meta device):
    the same model times differently in memory, under accelerate's hooks and under a streaming executor, and a
    streaming executor by how deep it reads ahead and how many bytes each forward reads (its ring decides both)."""
    device_map = getattr(model, "hf_device_map", None)
    if not device_map:
        return "in memory"
    units = Counter(str(where) for where in device_map.values())
    offloaded = sum(parameter.device.type == "meta" for parameter in model.parameters())
    placement = f"device map {dict(sorted(units.items()))}, {offloaded} tensors on meta"
    streamer = executor_of(model)
    if streamer is not None:
        placement += (
            f", {type(streamer).__name__} prefetch {streamer.prefetch}, "
            f"{streamer.streamed_bytes_per_forward} bytes per forward"
        )
    return placement


def forward_profile(model: PreTrainedModel, sizes: Sequence[int], use_disk: bool = True) -> ForwardProfile:
    """``model``'s forward-time profile, measured on first use and cached per model, placement (in memory or
    offloaded, and how), execution device, dtype and threads.

    The disk cache is ``<cache_root()>/forward_profiles.json`` (``$SPECEXEC_HF_CACHE`` moves it); delete it
    to re-measure after a hardware change.

    Args:
        model: The model to time.
        sizes: Token counts per forward.
        use_disk: Also read and write the on-disk cache.
    """
    key = _profile_key(model, sizes)
    if key not in _profiles:
        path = cache_root() / PROFILE_FILE_NAME
        stored = _read_profiles(path) if use_disk else {}
        if key in stored:
            _profiles[key] = ForwardProfile({int(n): s for n, s in stored[key].items()})
        else:
            _profiles[key] = measure_forward_profile(model, sizes)
            if use_disk:
                stored = _read_profiles(path)  # another process may have written meanwhile
                stored[key] = _profiles[key].seconds
                path.parent.mkdir(parents=True, exist_ok=True)
                staging = path.with_suffix(f".{os.getpid()}.tmp")
                staging.write_text(json.dumps(stored, indent=1))
                staging.replace(path)
    return _profiles[key]


def _read_profiles(path: Path) -> dict[str, dict[str, float]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


@dataclass
class AcceptanceProfile:
    """Running per-rank acceptance: at nodes the acceptance walk visited, how often the target's choice was the
    draft's rank-r child, counting only nodes that had a rank-r child in the tree.

    Args:
        hits: Per-rank count of walks that took the rank-r child.
        visits: Per-rank count of visited nodes that had a rank-r child.
    """

    hits: list[float] = field(default_factory=list)
    visits: list[float] = field(default_factory=list)

    @classmethod
    def with_prior(cls, ranks: int) -> AcceptanceProfile:
        """A weak prior worth one visit per rank, halving with each rank; a few steps outweigh it."""
        return cls(hits=[0.5 ** (r + 1) for r in range(ranks)], visits=[1.0] * ranks)

    def rates(self) -> list[float]:
        return [hit / visit for hit, visit in zip(self.hits, self.visits)]

    def observe(self, tree: TokenTree, acceptance: Acceptance) -> None:
        """Adds one step's walk: node ``[0, *path][i]`` was visited and the target chose ``tokens[i]`` there."""
        for node, chosen in zip([0, *acceptance.path], acceptance.tokens):
            children = tree.children(node)
            # Best-first trees keep each node's best children, so the order of their log-probs is the draft rank.
            ranked = tree.tokens[children[torch.argsort(-tree.logprobs[children], stable=True)]].tolist()
            for rank, token in enumerate(ranked[: len(self.visits)]):
                self.visits[rank] += 1
                self.hits[rank] += token == chosen


def tokens_within_budgets(tree: TokenTree, path: Sequence[int], budgets: Sequence[int]) -> dict[int, int]:
    """The tokens a step would have committed had its tree been only its best ``b`` nodes, for each ``b``.

    The tree's nodes ranked by score (the best-first order, ties to the lower index) put every parent ahead of its
    children, so the best ``b`` form a tree; the walk's path through it is the prefix of ``path`` ranked within the
    best ``b``, and the target's choice after it the bonus token.

    Args:
        tree: The verified tree (node 0 the root), ``logprobs`` its nodes' ranking scores.
        path: The walk's accepted tree nodes below the root.
        budgets: Tree sizes without the root.
    """
    rank = torch.empty(tree.num_nodes, dtype=torch.long)
    rank[rank_nodes(tree.logprobs.cpu())] = torch.arange(tree.num_nodes)
    ranks = rank[torch.tensor(list(path), dtype=torch.long)].tolist() if path else []
    within = {}
    for budget in budgets:
        prefix = next((i for i, r in enumerate(ranks) if r > budget), len(ranks))
        within[budget] = 1 + prefix
    return within


class AutoBudget:
    """Chooses each step's budget by modelled tokens per second.

    A step at budget ``B`` is modelled from the best ``B`` nodes under the running acceptance profile (the tree a
    best-first search grows, see :func:`~specexec_hf.core.static_trees.best_first_nodes`):

    - draft forwards: a node at depth ``d`` exists once its parent was fed, in forward ``d`` at the earliest (the
      first feeds the root), and one forward expands at most ``E = expand_per_forward`` nodes, so a tree takes
      ``max(depth, 1 + ceil(interior nodes / E))`` forwards, fewer where ``min_draft_gain`` stops the search: after
      the first forward that added less than that share of ``1 + forecast`` (the tree's nodes down to that depth);
      once trees have been grown, the forwards they took at their budget, blended with the model like the tokens
      (:meth:`_with_observed_forwards`);
    - tokens: 1 (the bonus) plus the acceptance of the nodes the search reached; once walks have been observed,
      the tokens they would have committed at that budget (:func:`tokens_within_budgets`, paired across budgets
      by :meth:`observed_tokens`), blended with the model over its first ``MODEL_WEIGHT_STEPS`` steps; above the
      largest observed budget, the model times the observed-to-modelled ratio there;
    - time: one target forward over ``B + 1`` tokens plus the observed forwards' excess over the profile at that
      budget, as a moving average from no excess in which each new forward weighs ``RECENT_WEIGHT`` (a budget not
      yet run takes the offset of the nearest one that has), the draft forwards at the measured time of one, scaled by
      the running ratio of observed to modelled draft time (which also covers the search's own host time), plus the
      running mean of the rest of a step (the walk, the caches): a cost every step pays whatever its size, which
      makes larger trees pay more.

    Args:
        target_seconds: Target forward time by token count.
        draft_forward_seconds: Time of one draft forward over ``expand_per_forward`` tokens.
        expand_per_forward: Nodes expanded per draft forward, as in :class:`SpecExecConfig`.
        acceptance: The running acceptance profile.
        candidates: Budgets to choose from.
        max_depth: Tree depth limit, as in :class:`SpecExecConfig`.
        min_draft_gain: As in :class:`SpecExecConfig`.
    """

    def __init__(
        self,
        target_seconds: ForwardProfile,
        draft_forward_seconds: float,
        expand_per_forward: int,
        acceptance: AcceptanceProfile,
        candidates: Sequence[int] = DEFAULT_CANDIDATES,
        max_depth: int | None = None,
        min_draft_gain: float = 0.0,
    ):
        self.target_seconds = target_seconds
        self.draft_forward_seconds = draft_forward_seconds
        self.expand_per_forward = expand_per_forward
        self.acceptance = acceptance
        self.candidates = sorted(candidates)
        self.max_depth = max_depth
        self.min_draft_gain = min_draft_gain
        self._draft_observed = 0.0
        self._draft_modelled = 0.0
        self._other_seconds = 0.0
        self._steps = 0
        # Per candidate budget: the tokens observed walks would have committed there, and how many walks.
        self._observed_tokens = dict.fromkeys(self.candidates, 0.0)
        self._observed_walks = dict.fromkeys(self.candidates, 0)
        # ... and what the same walks would have committed at the next smaller candidate (pairs the estimates).
        self._tokens_below = dict.fromkeys(self.candidates, 0.0)
        # Per candidate budget: the target forwards' moving excess over the profile, and how many were observed.
        self._target_offset = dict.fromkeys(self.candidates, 0.0)
        self._target_forwards = dict.fromkeys(self.candidates, 0)
        # Per candidate budget: the draft forwards of the trees grown there, and how many trees.
        self._draft_forwards = dict.fromkeys(self.candidates, 0)
        self._trees = dict.fromkeys(self.candidates, 0)

    def plan(self, max_depth: int | None = None) -> dict[int, tuple[float, float]]:
        """``{budget: (modelled tokens per step, modelled draft forwards)}`` for each candidate budget."""
        depth_limit = min(limit for limit in (self.max_depth, max_depth, max(self.candidates)) if limit is not None)
        parents, _, values = best_first_nodes(self.acceptance.rates(), max(self.candidates), depth_limit)
        depths = [0]
        for parent in parents[1:]:
            depths.append(depths[parent] + 1)
        plans = {}
        for budget in self.candidates:
            nodes = range(1, min(budget + 1, len(values)))
            deepest = max((depths[node] for node in nodes), default=0)
            # forecast[d]: the acceptance of the tree's nodes down to depth d, which forward d makes reachable.
            forecast = [0.0] * (deepest + 1)
            for node in nodes:
                forecast[depths[node]] += values[node]
            for depth in range(1, deepest + 1):
                forecast[depth] += forecast[depth - 1]
            interior = len({parents[node] for node in nodes} - {0})
            forwards = max(1, deepest, 1 + math.ceil(interior / self.expand_per_forward))
            if self.min_draft_gain > 0:
                stall = next(
                    (depth for depth in range(1, deepest + 1)
                     if forecast[depth] - forecast[depth - 1] < self.min_draft_gain * (1 + forecast[depth])),
                    None,
                )  # fmt: skip
                forwards = min(forwards, stall) if stall is not None else forwards
            plans[budget] = (1.0 + forecast[min(forwards, deepest)], forwards)
        return self._with_observed_forwards(self._with_observed_tokens(plans))

    def _with_observed_forwards(self, plans: dict[int, tuple[float, float]]) -> dict[int, tuple[float, float]]:
        """``plans`` with each budget's modelled draft forwards replaced by those its trees took, blended with the
        model over the first ``MODEL_WEIGHT_STEPS`` trees; a budget not yet run takes the model times the ratio at
        the nearest one that has. The model can count fewer forwards for a larger tree (its ``min_draft_gain``
        stop comes at a shallower depth when the forecast is larger): on the default pair streamed from disk it
        modelled 7 at budget 64 and 6 at 128, whose trees took 5.7 and 7.9, and "auto" ran 128 at 0.85x budget
        64's tokens/s."""
        grown = [budget for budget in self.candidates if self._trees[budget]]
        if not grown:
            return plans
        ratios = {}
        for budget in grown:
            trees, modelled = self._trees[budget], plans[budget][1]
            blended = (self._draft_forwards[budget] + MODEL_WEIGHT_STEPS * modelled) / (trees + MODEL_WEIGHT_STEPS)
            ratios[budget] = blended / modelled
        return {
            budget: (tokens, forwards * ratios[_nearest(grown, budget)])
            for budget, (tokens, forwards) in plans.items()
        }

    def _with_observed_tokens(self, plans: dict[int, tuple[float, int]]) -> dict[int, tuple[float, int]]:
        """``plans`` with each budget's modelled tokens replaced by what the walks observed there (see the class)."""
        estimates = self.observed_tokens()
        observed = {
            budget: (walks * estimates[budget] + MODEL_WEIGHT_STEPS * modelled) / (walks + MODEL_WEIGHT_STEPS)
            for budget, (modelled, _) in plans.items()
            if (walks := self._observed_walks[budget])
        }
        if not observed:
            return plans
        anchor = max(observed)
        ratio = observed[anchor] / plans[anchor][0]
        return {
            budget: (observed.get(budget, modelled * ratio), forwards) for budget, (modelled, forwards) in plans.items()
        }

    def observed_tokens(self) -> dict[int, float]:
        """Tokens per step observed at each budget some walk reached: the mean at the smallest candidate (every walk
        reaches it), and above it the estimate at the candidate below times the ratio of the two budgets' tokens over
        the walks that reached both.

        A walk reaches every candidate up to its tree's budget, so larger budgets are seen on fewer walks, often
        other prompts' (the choice moves as it learns): plain means would compare a budget seen on hard prompts with
        one seen on easy ones. The paired ratios compare them on the same walks, and, since no walk commits fewer
        tokens with more nodes, the estimates never fall as the budget grows.
        """
        estimates: dict[int, float] = {}
        below = None
        for budget in self.candidates:
            walks = self._observed_walks[budget]
            if not walks:
                break  # the reached budgets are the smallest ones
            estimates[budget] = (
                self._observed_tokens[budget] / walks
                if below is None
                else estimates[below] * self._observed_tokens[budget] / self._tokens_below[budget]
            )
            below = budget
        return estimates

    def expected_tokens(self, max_depth: int | None = None) -> dict[int, float]:
        """Modelled tokens per step (accepted draft tokens plus the bonus) for each candidate budget."""
        return {budget: tokens for budget, (tokens, _) in self.plan(max_depth).items()}

    def target_offset(self, budget: int) -> float:
        """Seconds the target's forward at ``budget`` is modelled to take beyond its profile (see the class)."""
        observed = [b for b in self.candidates if self._target_forwards[b]]
        if not observed:
            return 0.0
        return self._target_offset[_nearest(observed, budget)]

    def step_seconds(self, budget: int, draft_forwards: float) -> float:
        """Modelled wall time of a step: the target over the root and ``budget`` tree tokens (its profile and the
        observed offset), the draft's forwards (scaled by the observed draft time) and the rest of a step."""
        scale = self._draft_observed / self._draft_modelled if self._draft_modelled else 1.0
        other = self._other_seconds / self._steps if self._steps else 0.0
        target = self.target_seconds(budget + 1) + self.target_offset(budget)
        return target + scale * self.draft_forward_seconds * draft_forwards + other

    def tokens_per_second(self, max_depth: int | None = None) -> dict[int, float]:
        return {
            budget: tokens / self.step_seconds(budget, forwards)
            for budget, (tokens, forwards) in self.plan(max_depth).items()
        }

    def choose(self, max_depth: int | None = None) -> int:
        """The candidate budget with the highest modelled tokens per second (the smaller one on ties)."""
        return highest_rate(self.tokens_per_second(max_depth))

    def next_budget(self, max_depth: int | None = None) -> int:
        """The budget for the next step: :meth:`choose`'s, except on every ``PROBE_EVERY``-th step, which runs the
        candidate below it and above it in turn (see the module docstring; taking the better-modelled neighbour
        instead would keep probing the side that did not need it)."""
        best = self.choose(max_depth)
        if self._steps % PROBE_EVERY != PROBE_EVERY - 1:
            return best
        at = self.candidates.index(best)
        below, above = self.candidates[max(at - 1, 0) : at], self.candidates[at + 1 : at + 2]
        sides = (below + above) if (self._steps // PROBE_EVERY) % 2 == 0 else (above + below)
        return sides[0] if sides else best

    def describe(self) -> dict[str, object]:
        """The current model, for reports: acceptance rates, modelled tokens per step and tokens/s per budget."""
        return {
            "acceptance_rates": self.acceptance.rates(),
            "draft_time_scale": self._draft_observed / self._draft_modelled if self._draft_modelled else 1.0,
            "other_seconds_per_step": self._other_seconds / self._steps if self._steps else 0.0,
            "target_offset_seconds": {budget: self.target_offset(budget) for budget in self.candidates},
            "steps_by_budget": dict(self._target_forwards),
            "modelled_draft_forwards": {budget: forwards for budget, (_, forwards) in self.plan().items()},
            "modelled_tokens_per_step": self.expected_tokens(),
            "modelled_tokens_per_second": self.tokens_per_second(),
            "choice": self.choose(),
        }

    def observe(
        self,
        tree: TokenTree,
        acceptance: Acceptance,
        draft_seconds: float,
        draft_forwards: int,
        other_seconds: float = 0.0,
        budget: int | None = None,
        target_seconds: float | None = None,
    ) -> None:
        """Updates the acceptance profile, the observed tokens per budget and the time corrections with one step.

        Args:
            tree: The verified tree.
            acceptance: Its walk.
            draft_seconds: Time spent growing it.
            draft_forwards: The draft forwards that grew it.
            other_seconds: The step's time beside the draft and the target's forward (the walk, the caches).
            budget: The budget it was grown at (default: its size); a tree that stopped short of it (the search
                gained too little) is what every budget between its size and that one would have grown.
            target_seconds: The target's forward over the tree, as timed (``None``: not timed, no correction).
        """
        self.acceptance.observe(tree, acceptance)
        grown_at = tree.num_nodes - 1 if budget is None else budget
        reached = [b for b in self.candidates if b <= grown_at]
        within = tokens_within_budgets(tree, acceptance.path, reached)
        for below, b in zip(reached[:1] + reached, reached):  # the smallest is its own "below", never read
            self._observed_tokens[b] += within[b]
            self._observed_walks[b] += 1
            self._tokens_below[b] += within[below]
        if reached:
            self._trees[reached[-1]] += 1
            self._draft_forwards[reached[-1]] += draft_forwards
        if target_seconds is not None and reached:
            ran = reached[-1]
            self._target_forwards[ran] += 1
            excess = target_seconds - self.target_seconds(tree.num_nodes)
            self._target_offset[ran] += RECENT_WEIGHT * (excess - self._target_offset[ran])
        self._draft_observed += draft_seconds
        self._draft_modelled += self.draft_forward_seconds * draft_forwards
        self._other_seconds += other_seconds
        self._steps += 1


def _nearest(budgets: list[int], budget: int) -> int:
    """The one of ``budgets`` nearest ``budget`` by ratio, the smaller on a tie."""
    return min(budgets, key=lambda b: (abs(math.log(b / budget)), b))


def new_auto_budget(target: PreTrainedModel, draft: PreTrainedModel, config: SpecExecConfig) -> AutoBudget:
    """A fresh :class:`AutoBudget` for the pair at these tree knobs: cached forward profiles, a prior acceptance
    profile. ``generate(budget="auto")`` keeps one per setting in its :class:`~.learnt_state.LearntState`.

    Args:
        target: The target model.
        draft: The draft model.
        config: ``max_depth``, ``max_branch`` (acceptance ranks tracked), ``expand_per_forward`` and
            ``min_draft_gain``.
    """
    return AutoBudget(
        forward_profile(target, [b + 1 for b in DEFAULT_CANDIDATES]),
        forward_profile(draft, [config.expand_per_forward])(config.expand_per_forward),
        config.expand_per_forward,
        AcceptanceProfile.with_prior(config.max_branch),
        DEFAULT_CANDIDATES,
        config.max_depth,
        config.min_draft_gain,
    )
