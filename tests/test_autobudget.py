"""budget="auto": the modelled tokens/s argmax, the running acceptance profile, profile caching, exact output."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import perturbed_copy, tiny_model
from hypothesis import given
from hypothesis import strategies as st
from test_offload import offloaded_copy, prompt
from transformers import AutoModelForCausalLM

from specexec_hf import SpecExecConfig, SpecExecStats, TokenTree
from specexec_hf.core.static_trees import best_first_nodes
from specexec_hf.core.verify import Acceptance
from specexec_hf.hf import autobudget
from specexec_hf.hf.autobudget import AcceptanceProfile, AutoBudget, ForwardProfile
from specexec_hf.offload import load_offloaded

CANDIDATES = (8, 16, 32, 64, 128, 256, 512, 1024)


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    """Forward profiles go to a fresh directory and in-process cache for every test."""
    monkeypatch.setenv("SPECEXEC_HF_CACHE", str(tmp_path))
    monkeypatch.setattr(autobudget, "_profiles", {})


def modelled_plan(rates, budget, expand_per_forward, max_depth, gain):
    """A direct reading of AutoBudget's model: (tokens per step, draft forwards) of the best ``budget`` nodes."""
    parents, _, values = best_first_nodes(rates, max(CANDIDATES), min(max_depth, max(CANDIDATES)))
    nodes = list(range(1, min(budget + 1, len(values))))
    depth = {0: 0}
    for node in nodes:
        depth[node] = depth[parents[node]] + 1
    deepest = max((depth[node] for node in nodes), default=0)

    def reached(limit):  # the acceptance of the nodes down to depth ``limit``
        return sum(values[node] for node in nodes if depth[node] <= limit)

    interior = {parents[node] for node in nodes} - {0}
    forwards = max(1, deepest, 1 + math.ceil(len(interior) / expand_per_forward))
    for limit in range(1, deepest + 1):
        if gain > 0 and reached(limit) - reached(limit - 1) < gain * (1 + reached(limit)):
            forwards = min(forwards, limit)
            break
    return 1 + reached(forwards), forwards


@given(
    fixed=st.floats(1e-3, 1.0),
    per_token=st.floats(0.0, 1e-2),
    draft_forward=st.floats(0.0, 0.1),
    expand_per_forward=st.integers(1, 32),
    rates=st.lists(st.floats(0.0, 1.0), min_size=1, max_size=8),
    max_depth=st.integers(1, 16),
    gain=st.sampled_from([0.0, 0.03, 0.2]),
)
def test_choice_is_the_argmax_of_modelled_tokens_per_second(
    fixed, per_token, draft_forward, expand_per_forward, rates, max_depth, gain
):
    profile = ForwardProfile({b + 1: fixed + per_token * (b + 1) for b in CANDIDATES})
    acceptance = AcceptanceProfile(hits=rates, visits=[1.0] * len(rates))
    auto = AutoBudget(profile, draft_forward, expand_per_forward, acceptance, CANDIDATES, max_depth, gain)

    def modelled(budget: int) -> float:
        tokens, forwards = modelled_plan(rates, budget, expand_per_forward, max_depth, gain)
        return tokens / (fixed + per_token * (budget + 1) + draft_forward * forwards)

    best = max(modelled(b) for b in CANDIDATES)
    chosen = auto.choose()
    assert math.isclose(modelled(chosen), best, rel_tol=1e-9)
    assert chosen == min(b for b in CANDIDATES if math.isclose(modelled(b), best, rel_tol=1e-9))
    # A forward adds at least one node (the root's first), and a tree needs at least the forward that feeds its root.
    assert all(1 <= auto.plan()[b][1] <= 1 + b for b in CANDIDATES)


@given(
    expand_per_forward=st.integers(1, 32),
    rates=st.lists(st.floats(0.05, 1.0), min_size=1, max_size=4),
    gain=st.floats(0.001, 0.3),
)
def test_min_draft_gain_caps_the_modelled_forwards_and_tokens(expand_per_forward, rates, gain):
    acceptance = AcceptanceProfile(hits=rates, visits=[1.0] * len(rates))
    flat = ForwardProfile({b + 1: 1.0 for b in CANDIDATES})
    free = AutoBudget(flat, 0.01, expand_per_forward, acceptance, CANDIDATES, None, 0.0).plan()
    stopped = AutoBudget(flat, 0.01, expand_per_forward, acceptance, CANDIDATES, None, gain).plan()
    for budget in CANDIDATES:
        assert stopped[budget][1] <= free[budget][1] and stopped[budget][0] <= free[budget][0] + 1e-9


def test_flat_forward_time_picks_a_large_budget_and_linear_time_a_small_one():
    acceptance = AcceptanceProfile(hits=[0.8, 0.1, 0.05], visits=[1.0, 1.0, 1.0])
    offloaded = ForwardProfile({b + 1: 1.0 for b in CANDIDATES})  # weights streamed: tokens are nearly free
    compute_bound = ForwardProfile({b + 1: 0.01 * (b + 1) for b in CANDIDATES})
    assert AutoBudget(offloaded, 0.0, 16, acceptance, CANDIDATES).choose() == 1024
    assert AutoBudget(compute_bound, 0.0, 16, acceptance, CANDIDATES).choose() == 8


def test_observed_times_rescale_the_draft_and_add_the_rest_of_a_step():
    acceptance = AcceptanceProfile(hits=[0.9], visits=[1.0])
    auto = AutoBudget(ForwardProfile({b + 1: 1.0 for b in CANDIDATES}), 0.01, 16, acceptance, CANDIDATES)
    assert auto.step_seconds(32, draft_forwards=3) == pytest.approx(1.0 + 0.03)
    tree = TokenTree.from_root(0)
    tree.add_children(torch.zeros(16, dtype=torch.long), torch.arange(16), torch.full((16,), -1.0))
    # Two forwards modelled at 0.02 s took 0.2 s: 10x slower; the walk and the caches took 0.05 s more.
    auto.observe(tree, Acceptance(path=[], tokens=[99]), draft_seconds=0.2, draft_forwards=2, other_seconds=0.05)
    assert auto.step_seconds(32, draft_forwards=3) == pytest.approx(1.0 + 0.3 + 0.05)


def test_observed_target_forwards_offset_the_profile_at_their_budget_and_the_nearest_unrun_ones():
    acceptance = AcceptanceProfile(hits=[0.9], visits=[1.0])
    profile = ForwardProfile({b + 1: 0.2 + 0.001 * (b + 1) for b in CANDIDATES})
    auto = AutoBudget(profile, 0.0, 16, acceptance, CANDIDATES)
    assert all(auto.target_offset(b) == 0.0 for b in CANDIDATES)
    tree = TokenTree.from_root(0)
    tree.add_children(torch.zeros(16, dtype=torch.long), torch.arange(16), torch.full((16,), -1.0))
    walk = Acceptance(path=[], tokens=[99])
    # A budget-64 tree that stopped at 16 nodes: its forward is measured against the profile at its own 17 tokens.
    for _ in range(4):
        auto.observe(tree, walk, 0.0, 1, budget=64, target_seconds=profile(17) + 0.3)
    auto.observe(tree, walk, 0.0, 1, budget=16, target_seconds=profile(17) - 0.1)
    at_64 = 0.3 * (1 - (1 - autobudget.RECENT_WEIGHT) ** 4)  # moving from no offset, each new forward weighing half
    at_16 = -0.1 * autobudget.RECENT_WEIGHT
    assert auto.target_offset(64) == pytest.approx(at_64) and auto.target_offset(16) == pytest.approx(at_16)
    assert [auto.target_offset(b) for b in (8, 32)] == pytest.approx([at_16, at_16])  # 32: a tie, the smaller
    assert [auto.target_offset(b) for b in (128, 1024)] == pytest.approx([at_64, at_64])
    assert auto.step_seconds(128, draft_forwards=2) == pytest.approx(profile(129) + at_64)
    assert auto.describe()["steps_by_budget"] == {**dict.fromkeys(CANDIDATES, 0), 16: 1, 64: 4}


def chain(length: int) -> TokenTree:
    """A chain of ``length`` nodes below the root, each less likely than its parent (node i ranks i-th)."""
    tree = TokenTree.from_root(0)
    for node in range(1, length + 1):
        tree.add_children(torch.tensor([node - 1]), torch.tensor([node]), torch.tensor([-0.01 * node]))
    return tree


@given(
    walks=st.lists(
        st.tuples(st.sampled_from(CANDIDATES[:5]), st.integers(0, 128)), min_size=1, max_size=30
    )
)
def test_observed_tokens_never_fall_as_the_budget_grows(walks):
    auto = AutoBudget(ForwardProfile({1: 1.0}), 0.01, 16, AcceptanceProfile.with_prior(2), CANDIDATES)
    tree = chain(128)
    for grown_at, accepted in walks:  # each walk accepts the chain's first nodes, on a tree grown at some budget
        auto.observe(tree, Acceptance(path=list(range(1, accepted + 1)), tokens=[0] * (accepted + 1)), 0.0, 1,
                     budget=grown_at)
    estimates = auto.observed_tokens()
    assert list(estimates) == [b for b in CANDIDATES if b <= max(grown_at for grown_at, _ in walks)]
    assert all(estimates[a] <= estimates[b] + 1e-9 for a, b in zip(estimates, list(estimates)[1:]))
    everyone = [1 + min(accepted, CANDIDATES[0]) for _, accepted in walks]
    assert estimates[CANDIDATES[0]] == pytest.approx(sum(everyone) / len(everyone))


def test_budgets_seen_on_other_prompts_are_compared_on_the_walks_that_saw_both():
    auto = AutoBudget(ForwardProfile({1: 1.0}), 0.01, 16, AcceptanceProfile.with_prior(2), CANDIDATES)
    # Hard prompts first, on trees grown at 64: 40 children of the root, the best with one child that ranks 41st;
    # the walk takes both: 2 tokens within 8 or 32 nodes, 3 within 64.
    star = TokenTree.from_root(0)
    star.add_children(torch.zeros(40, dtype=torch.long), torch.arange(40), -0.01 * torch.arange(1, 41))
    star.add_children(torch.tensor([1]), torch.tensor([99]), torch.tensor([-1.0]))
    for _ in range(10):
        auto.observe(star, Acceptance(path=[1, 41], tokens=[0, 99, 0]), 0.0, 1, budget=64)
    # Then easy ones at 32: 6 tokens within 8 nodes and within 32.
    for _ in range(30):
        auto.observe(chain(32), Acceptance(path=[1, 2, 3, 4, 5], tokens=[0] * 6), 0.0, 1, budget=32)
    estimates = auto.observed_tokens()
    mean_at_8 = (10 * 2 + 30 * 6) / 40
    assert estimates[8] == pytest.approx(mean_at_8) and estimates[32] == pytest.approx(mean_at_8)
    assert estimates[64] == pytest.approx(mean_at_8 * 3 / 2)  # the hard walks' own gain from 32 to 64 nodes
    # A plain mean per budget would have put 64 (3 tokens, hard prompts only) below 32 (5 tokens).


@pytest.mark.parametrize(
    "observed",
    [
        {"other_seconds": 1.0},  # the walk and the caches took 1 s
        {"target_seconds": 0.1 + 0.002 + 1.0},  # the disk is slower than profiled: the forward took 1 s more
    ],
    ids=["rest of the step", "target forward"],
)
def test_a_fixed_cost_per_step_favours_larger_trees(observed):
    acceptance = AcceptanceProfile(hits=[0.7, 0.2], visits=[1.0, 1.0])
    linear = ForwardProfile({b + 1: 0.1 + 0.002 * (b + 1) for b in CANDIDATES})
    auto = AutoBudget(linear, 0.01, 16, acceptance, CANDIDATES, None, 0.03)
    without = auto.choose()
    tree = TokenTree.from_root(0)  # one token scored: the profile says 0.102 s
    for _ in range(10):
        auto.observe(tree, Acceptance(path=[], tokens=[1]), 0.01, 1, budget=without, **observed)
    assert auto.choose() > without


def test_a_budget_slowed_by_a_few_early_steps_is_probed_and_taken_back():
    """Three steps at 64 met a slow disk and the steps moved to 128. Its own steps never correct 64's offset;
    the probes of the neighbours every PROBE_EVERY steps do, and the choice comes back to 64, the best at the true
    costs (walks accept 40 tokens of chains: 41 tokens at 64 or more, at forwards of 0.2 s plus 0.4 ms a token)."""
    profile = ForwardProfile({b + 1: 0.2 + 0.0004 * (b + 1) for b in CANDIDATES})
    auto = AutoBudget(profile, 0.0, 16, AcceptanceProfile.with_prior(2), CANDIDATES)

    def step(budget: int, slow: float = 0.0) -> None:
        accepted = min(40, budget)
        walk = Acceptance(path=list(range(1, accepted + 1)), tokens=[*range(1, accepted + 1), 0])
        auto.observe(chain(budget), walk, 0.0, 1, budget=budget, target_seconds=profile(budget + 1) + slow)

    for _ in range(4):
        step(1024)  # walks of every size: 41 tokens at 64 and beyond
    for _ in range(3):
        step(64, slow=0.5)
    for _ in range(10):
        step(128)
    assert auto.choose() == 128  # 64 (and everything below it, nearest to it) still pays the slow steps
    chosen = []
    for _ in range(96):
        budget = auto.next_budget()
        probe = auto._steps % autobudget.PROBE_EVERY == autobudget.PROBE_EVERY - 1
        assert probe or budget == auto.choose()  # off the probe steps, the best-modelled budget
        chosen.append(budget)
        step(budget)
    assert auto.choose() == 64 and chosen[-8:].count(64) >= 7


@given(seconds=st.dictionaries(st.integers(1, 2048), st.floats(0.0, 10.0), min_size=1, max_size=8))
def test_forward_profiles_never_fall_as_tokens_grow(seconds):
    """A count timed slower than a larger one takes the larger one's time; monotone timings are kept as they are."""
    profile = ForwardProfile(seconds)
    sizes = sorted(seconds)
    assert all(profile(small) <= profile(large) for small, large in zip(sizes, sizes[1:]))
    assert all(profile(size) == min(seconds[s] for s in sizes if s >= size) for size in sizes)


def test_forward_profile_interpolates_and_extends_linearly():
    profile = ForwardProfile({2: 1.0, 4: 2.0, 8: 2.0})
    assert profile(3) == 1.5 and profile(4) == 2.0 and profile(6) == 2.0
    assert profile(1) == 0.5 and profile(16) == 2.0


def test_acceptance_profile_counts_ranks_present_at_visited_nodes():
    # Root 0 with children 1 (token 5, best) and 2 (token 7); node 1 with child 3 (token 9).
    tree = TokenTree(
        tokens=torch.tensor([0, 5, 7, 9]),
        parents=torch.tensor([-1, 0, 0, 1]),
        depths=torch.tensor([0, 1, 1, 2]),
        logprobs=torch.tensor([0.0, -0.1, -2.0, -0.5]),
    )
    profile = AcceptanceProfile(hits=[0.0] * 3, visits=[0.0] * 3)
    # The target took token 5 (rank 0) at the root, then 4 at node 1, which has one child only.
    profile.observe(tree, Acceptance(path=[1], tokens=[5, 4]))
    assert profile.hits == [1.0, 0.0, 0.0] and profile.visits == [2.0, 1.0, 0.0]


def test_profiles_are_measured_once_then_read_from_disk(monkeypatch):
    model = tiny_model("llama", seed=0)
    first = autobudget.forward_profile(model, [1, 4])
    assert sorted(first.seconds) == [1, 4]
    monkeypatch.setattr(autobudget, "_profiles", {})

    def fail(*args, **kwargs):
        raise AssertionError("the profile should have come from the disk cache")

    monkeypatch.setattr(autobudget, "measure_forward_profile", fail)
    assert autobudget.forward_profile(model, [1, 4]).seconds == first.seconds


@given(seed=st.integers(0, 2**16), max_new_tokens=st.integers(1, 24), noise=st.sampled_from([0.0, 0.05]))
def test_auto_budget_keeps_greedy_output(seed, max_new_tokens, noise):
    target = tiny_model("llama", seed=seed % 4)  # few distinct models: each profile is measured once
    draft = perturbed_copy(target, noise, seed=seed + 1)
    ids = torch.randint(0, 64, (1, 5), generator=torch.Generator().manual_seed(seed))
    expected = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
    stats = SpecExecStats()
    got = target.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=draft, speculator="specexec",
        budget="auto", specexec_stats=stats,
    )
    assert got.tolist() == expected.tolist()
    assert all(step.tree_size - 1 <= max(CANDIDATES) for step in stats.steps)


def test_config_accepts_auto_only_as_the_budget():
    assert SpecExecConfig(budget="auto").budget == "auto"
    for bad in ("Auto", "64", 0):
        with pytest.raises(ValueError):
            SpecExecConfig(budget=bad)
    with pytest.raises(ValueError):
        SpecExecConfig(max_depth="auto")


# A user's own from_pretrained(device_map=...) with cpu and disk entries; the embedding on disk leaves its weight on
# the meta device, where budget="auto" used to build its timing inputs.
OWN_DEVICE_MAP = {"model.embed_tokens": "disk", "model.rotary_emb": "cpu", "model.layers.0": "cpu",
                  "model.layers.1": "disk", "model.norm": "cpu", "lm_head": "disk"}
TARGET_PLACEMENTS = [
    *[(executor, placement) for executor in ("accelerate", "stream") for placement in ("all on disk", "cpu and disk")],
    ("own device_map", "cpu and disk"),
]


def placed_target(model, executor: str, placement: str, folder: str):
    """``model`` offloaded as ``load_offloaded`` places it, or loaded by a user with their own ``device_map``."""
    if executor != "own device_map":
        return offloaded_copy(model, folder, placement, executor)
    model.save_pretrained(f"{folder}/checkpoint")
    return AutoModelForCausalLM.from_pretrained(
        f"{folder}/checkpoint", device_map=OWN_DEVICE_MAP, offload_folder=f"{folder}/offload",
        attn_implementation="sdpa",
    )


@pytest.mark.parametrize("executor,placement", TARGET_PLACEMENTS)
def test_auto_budget_on_offloaded_targets_keeps_greedy_output(tmp_path, executor, placement):
    target = tiny_model("llama", seed=5)
    draft = perturbed_copy(target, 0.05, seed=6)
    ids = prompt(5, 6)
    expected = target.generate(ids, max_new_tokens=16, do_sample=False)
    offloaded = placed_target(target, executor, placement, str(tmp_path))
    assert "disk" in offloaded.hf_device_map.values()
    got = offloaded.generate(
        ids, max_new_tokens=16, do_sample=False, assistant_model=draft, speculator="specexec", budget="auto"
    )
    assert got.tolist() == expected.tolist()


def test_offloaded_copy_gets_its_own_profile(tmp_path, monkeypatch):
    """The in-memory model's forward times say nothing about its offloaded copy's: neither reuses the other's, nor
    one executor's another's."""
    model = tiny_model("llama", seed=0)
    measured = []
    measure = autobudget.measure_forward_profile

    def counted(model, sizes):
        measured.append(model)
        return measure(model, sizes)

    monkeypatch.setattr(autobudget, "measure_forward_profile", counted)
    autobudget.forward_profile(model, [1, 4])
    for executor, options in (("accelerate", {}), ("stream", {"prefetch": 1}), ("stream", {"prefetch": 2})):
        folder = str(tmp_path / f"{executor}{options}")
        autobudget.forward_profile(offloaded_copy(model, folder, "cpu and disk", executor, **options), [1, 4])
    assert len(measured) == 4  # a stream executor reading ahead deeper times differently, too


@pytest.mark.parametrize("budget", [8, "auto"])
def test_draft_offloaded_by_accelerate_runs_where_its_hooks_compute(tmp_path, budget):
    """A draft whose weights accelerate keeps on disk (its parameters on the meta device) grows its trees on the
    device its hooks run it on."""
    target = tiny_model("llama", seed=7)
    ids = prompt(7, 5)
    expected = target.generate(ids, max_new_tokens=16, do_sample=False)
    draft = load_offloaded(
        perturbed_copy(target, 0.05, seed=8), max_memory={"cpu": 0}, offload_folder=str(tmp_path), executor="accelerate"
    )
    assert draft.get_input_embeddings().weight.device.type == "meta"
    got = target.generate(
        ids, max_new_tokens=16, do_sample=False, assistant_model=draft, speculator="specexec", budget=budget
    )
    assert got.tolist() == expected.tolist()


@st.composite
def walked_trees(draw):
    """A tree whose children score at most their parent (as best-first trees do, ties included), and a walk down it:
    (tree, accepted path below the root, the walk's tokens with the bonus token last)."""
    tree = TokenTree.from_root(0)
    for node in range(1, draw(st.integers(1, 40)) + 1):
        parent = draw(st.integers(0, node - 1))
        drop = draw(st.sampled_from([0.0, 0.0, 0.5, 1.0, 2.5]))  # repeated scores exercise the index tie-break
        score = float(tree.logprobs[parent]) - drop
        tree.add_children(torch.tensor([parent]), torch.tensor([node]), torch.tensor([score]))
    parents, tokens = tree.host_lists()
    path, node = [], 0
    while (children := [c for c in range(tree.num_nodes) if c > 0 and parents[c] == node]) and draw(st.booleans()):
        node = draw(st.sampled_from(children))
        path.append(node)
    return tree, path, [tokens[n] for n in path] + [-1]


@given(walked=walked_trees(), budgets=st.lists(st.integers(1, 48), min_size=1, max_size=6, unique=True))
def test_tokens_within_a_budget_are_the_walk_through_the_trees_best_nodes(walked, budgets):
    from specexec_hf.core.search import rank_nodes, walked_nodes

    tree, path, choices = walked
    within = autobudget.tokens_within_budgets(tree, path, budgets)
    for budget in budgets:
        best = rank_nodes(tree.logprobs)[: budget + 1].sort().values
        assert best.tolist() == sorted(set(best.tolist()))
        smaller = tree.select(best)
        assert within[budget] == len(walked_nodes(smaller, choices))  # each node visited commits one token


def test_observed_walks_replace_the_modelled_tokens_and_move_the_choice_to_smaller_trees():
    acceptance = AcceptanceProfile(hits=[0.8, 0.3, 0.1], visits=[1.0, 1.0, 1.0])
    sublinear = ForwardProfile({b + 1: 1.0 + 0.002 * (b + 1) for b in CANDIDATES})
    auto = AutoBudget(sublinear, 0.01, 16, acceptance, CANDIDATES)
    first = auto.choose()
    tree = chain(300)  # whose walks accept its first two nodes: deeper nodes never pay
    for _ in range(20):
        auto.observe(tree, Acceptance(path=[1, 2], tokens=[1, 2, 7]), 0.01, 1, budget=256)
    observed = auto.expected_tokens()
    modelled = AutoBudget(sublinear, 0.01, 16, auto.acceptance, CANDIDATES).expected_tokens()  # same profile, no walks
    for budget in (8, 16, 32, 64, 128, 256):  # observed: 3 tokens, blended with the model over its first steps
        assert observed[budget] == pytest.approx((20 * 3 + 2 * modelled[budget]) / 22)
    for budget in (512, 1024):  # above the largest observed budget: the model times the ratio observed there
        assert observed[budget] == pytest.approx(modelled[budget] * observed[256] / modelled[256])
    assert first >= 128 and auto.choose() <= 16  # nothing past depth 2 pays: the smallest trees that hold it


def test_observed_draft_forwards_replace_the_modelled_ones_and_scale_the_nearest_unrun_budgets():
    """The model can count fewer forwards for a larger tree; the trees' own counts decide once they are grown."""
    acceptance = AcceptanceProfile(hits=[0.6, 0.2], visits=[1.0, 1.0])
    profile = ForwardProfile({b + 1: 0.2 for b in CANDIDATES})
    auto = AutoBudget(profile, 0.02, 16, acceptance, CANDIDATES)

    def modelled() -> dict[int, float]:  # the model alone, under the acceptance the walks have updated
        return {budget: forwards for budget, (_, forwards) in AutoBudget(
            profile, 0.02, 16, auto.acceptance, CANDIDATES).plan().items()}

    walk = Acceptance(path=[], tokens=[99])
    for _ in range(6):
        auto.observe(chain(64), walk, 0.0, 10, budget=64)
    weight = autobudget.MODEL_WEIGHT_STEPS
    model = modelled()
    at_64 = (6 * 10 + weight * model[64]) / (6 + weight)
    plan = auto.plan()
    assert plan[64][1] == pytest.approx(at_64)
    for budget in (32, 128, 1024):  # not grown: the ratio at 64, the nearest grown budget
        assert plan[budget][1] == pytest.approx(model[budget] * at_64 / model[64])
    auto.observe(chain(128), walk, 0.0, 3, budget=128)
    model = modelled()
    at_128 = (3 + weight * model[128]) / (1 + weight)
    assert auto.plan()[128][1] == pytest.approx(at_128)
    assert auto.plan()[256][1] == pytest.approx(model[256] * at_128 / model[128])  # its nearest grown budget: 128


def test_a_larger_budget_whose_trees_take_more_forwards_than_modelled_loses_the_choice():
    """As on the default pair streamed from disk: the model gave budget 128 no more draft forwards than 64."""
    acceptance = AcceptanceProfile(hits=[0.5, 0.05], visits=[1.0, 1.0])
    auto = AutoBudget(ForwardProfile({b + 1: 0.15 for b in CANDIDATES}), 0.01, 16, acceptance, [64, 128], None, 0.03)
    plan = auto.plan()
    assert plan[128][1] <= plan[64][1] and auto.choose() == 128  # the model's view: the larger tree costs no more
    for _ in range(12):  # 128's trees hold more of the walk, and take four times 64's draft forwards
        auto.observe(chain(64), Acceptance(path=list(range(1, 65)), tokens=list(range(65))), 0.05, 5, budget=64)
        auto.observe(chain(128), Acceptance(path=list(range(1, 81)), tokens=list(range(81))), 0.2, 20, budget=128)
    tokens = auto.expected_tokens()
    assert tokens[128] > tokens[64] and auto.choose() == 64
