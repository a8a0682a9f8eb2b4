"""Near-ties (specexec_hf.core.precision): the detector, and what it certifies about 16-bit greedy SpecExec."""

from __future__ import annotations

import pytest
import torch
from conftest import perturbed_copy, tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st

from specexec_hf import SpecExecStats, StepStats
from specexec_hf.core.precision import greedy_choice, native_bfloat16_cpu, rounding_bound

BF16_EPS = torch.finfo(torch.bfloat16).eps


@given(
    top=st.floats(-50, 50), gap_in_bounds=st.floats(0, 3), eps=st.sampled_from([BF16_EPS, 2**-10, 2**-23]),
    reduction=st.integers(1, 8192), vocab=st.integers(2, 40), seed=st.integers(0, 2**16),
)  # fmt: skip
def test_greedy_choice_is_the_argmax_and_flags_gaps_within_the_bound(top, gap_in_bounds, eps, reduction, vocab, seed):
    second = torch.tensor(top, dtype=torch.float64)
    bound = float(rounding_bound(torch.stack([second, second]), eps, reduction))  # the bound at (top, ~top)
    gap = gap_in_bounds * bound
    scores = torch.full((vocab,), top - 10 * bound - 1.0, dtype=torch.float64)
    order = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))
    scores[order[0]], scores[order[1]] = top, top - gap
    token, tied = greedy_choice(scores[None], eps, reduction).tolist()
    assert token == int(scores.argmax())  # the first maximum, as plain greedy takes it, exact ties included
    top_two = scores[order[:2]]
    assert tied == bool(top_two[0] - top_two[1] <= rounding_bound(top_two, eps, reduction))
    if gap_in_bounds < 0.9:
        assert tied
    elif gap_in_bounds > 1.1:
        assert not tied


def test_an_infinite_runner_up_is_no_tie():
    scores = torch.tensor([[2.0, float("-inf"), float("-inf")]])
    assert greedy_choice(scores, BF16_EPS, 64).tolist() == [0, 0]


@given(scale=st.floats(0.01, 100), z1=st.floats(-30, 30), z2=st.floats(-30, 30))
def test_the_bound_scales_with_the_logits_and_grows_with_the_reduction(scale, z1, z2):
    pair = torch.tensor([z1, z2], dtype=torch.float64)
    assert torch.isclose(rounding_bound(scale * pair, BF16_EPS, 576), scale * rounding_bound(pair, BF16_EPS, 576))
    assert rounding_bound(pair, BF16_EPS, 4096) >= rounding_bound(pair, BF16_EPS, 64)
    # 16-bit: about 4 eps |z| (the float32 accumulation adds little); float32: a few parts in a million.
    assert rounding_bound(pair, BF16_EPS, 576) <= 2.1 * BF16_EPS * pair.abs().sum()
    assert rounding_bound(pair, 2**-23, 576) <= 1e-5 * pair.abs().sum() + 1e-12


def twin_head_model(dtype: torch.dtype):
    """A tiny Llama whose output rows come in identical pairs (tokens 2k and 2k + 1): every greedy choice is an exact
    tie, which argmax breaks to the even token."""
    model = tiny_model("llama", seed=3, dtype=dtype)
    with torch.no_grad():
        model.lm_head.weight[1::2] = model.lm_head.weight[0::2]
    return model


def speculate(target, draft, ids, stats, max_new_tokens=12):
    return target.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=draft, speculator="specexec", budget=8,
        specexec_stats=stats,
    )  # fmt: skip


def test_a_constructed_tie_in_bfloat16_is_counted_at_every_choice():
    target = twin_head_model(torch.bfloat16)
    draft = perturbed_copy(target, 0.0, seed=0)
    ids = torch.randint(0, 64, (1, 6), generator=torch.Generator().manual_seed(0))
    stats = SpecExecStats()
    out = speculate(target, draft, ids, stats)[0, 6:].tolist()
    assert len(out) == 12 and all(token % 2 == 0 for token in out)
    assert stats.near_tied_positions == list(range(12))
    assert stats.near_ties >= 12 and stats.summary()["near_ties"] == stats.near_ties


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**16), noise=st.sampled_from([0.0, 0.05]))
def test_bfloat16_speculation_follows_plain_greedy_up_to_its_first_near_tie(seed, noise):
    """The certificate ``near_tied_positions`` gives: every choice before the first near-tie had a margin wider than
    rounding, so plain greedy decoding in the same dtype made it too. Fails if the bound is too tight."""
    target = tiny_model("llama", seed=seed, vocab_size=256, sharpness=2.0, dtype=torch.bfloat16)
    draft = perturbed_copy(target, noise, seed=seed + 1)
    ids = torch.randint(0, 256, (1, 8), generator=torch.Generator().manual_seed(seed))
    stats = SpecExecStats()
    spec = speculate(target, draft, ids, stats, max_new_tokens=24)[0, 8:].tolist()
    plain = target.generate(ids, max_new_tokens=24, do_sample=False)[0, 8:].tolist()
    certified = (stats.near_tied_positions or [len(plain)])[0]
    assert spec[:certified] == plain[:certified], (stats.near_tied_positions, spec, plain)


@pytest.mark.parametrize("seed", [0, 1])
def test_float64_greedy_has_no_near_ties_and_equals_plain_greedy(seed):
    target = tiny_model("llama", seed=seed)  # float64: ties within rounding are ties to ~1e-15
    draft = perturbed_copy(target, 0.05, seed=seed + 1)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(seed))
    stats = SpecExecStats()
    spec = speculate(target, draft, ids, stats)
    assert stats.near_ties == 0
    assert torch.equal(spec, target.generate(ids, max_new_tokens=12, do_sample=False))


def test_stats_print_a_summary_and_keep_their_steps():
    steps = [StepStats(9, 3, 2, 0.01, 0.02, 2, 1.5, (1,)), StepStats(9, 2, 2, 0.01, 0.02, 1, 1.0, (0, 1))]
    stats = SpecExecStats(steps)
    text = repr(stats)
    assert "steps=2" in text and "near_ties=3" in text and "tokens_per_target_forward=2.50" in text
    assert "StepStats" not in text and stats.steps == steps
    assert stats.near_tied_positions == [1, 3, 4]


def test_the_environment_overrides_the_native_bfloat16_probe(monkeypatch: pytest.MonkeyPatch) -> None:
    for forced, expected in (("1", True), ("0", False)):
        monkeypatch.setenv("SPECEXEC_NATIVE_BFLOAT16", forced)
        assert native_bfloat16_cpu() is expected
    monkeypatch.setenv("SPECEXEC_NATIVE_BFLOAT16", "yes")
    with pytest.raises(ValueError, match="SPECEXEC_NATIVE_BFLOAT16='yes': set it to 1 or 0"):
        native_bfloat16_cpu()
