"""SpecExec's settings through a ``GenerationConfig`` (passed to ``generate()``, set as ``model.generation_config``,
saved in ``generation_config.json``), keywords winning over it; assisted-generation settings SpecExec does not use
named in a warning; a pipeline's batch refused by naming ``batch_size``."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import perturbed_copy, tiny_model, tiny_tokenizer
from hypothesis import given
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM, GenerationConfig, pipeline

import specexec_hf
from specexec_hf import SpecExecConfig, SpecExecStats
from specexec_hf.hf import generation
from specexec_hf.hf.settings import OTHER_SETTINGS, specexec_settings

IDS = torch.tensor([[1, 2, 3, 4]])
NEW_TOKENS = 12
# A value off the default for every setting a generation config may hold.
CONFIGURED = {
    "budget": 5, "max_depth": 3, "max_branch": 4, "expand_per_forward": 2, "max_draft_forwards": 7,
    "min_draft_gain": 0.1, "draft_temperature": 0.8, "context_match_weights": (0.5, 0.7),
    "acceptance_calibration": False, "sampled_children": True, "draft_ahead": True, "tree_search": "specinfer",
    "draft_budget": 9, "draft_graphs": "off",
}
KEYWORDS = {
    "budget": 3, "max_depth": 2, "max_branch": 2, "expand_per_forward": 3, "max_draft_forwards": 1,
    "min_draft_gain": 0.2, "draft_temperature": 1.5, "context_match_weights": (0.1,), "acceptance_calibration": True,
    "sampled_children": False, "draft_ahead": False, "tree_search": "sequoia", "draft_budget": 6,
    "draft_graphs": "on",
}


@pytest.fixture(scope="module")
def pair():
    target = tiny_model("llama", seed=0, dtype=torch.float32)
    return target, perturbed_copy(target, 0.0, seed=1)  # a perfect draft: every tree is accepted to its depth


@pytest.fixture
def fresh_target(pair):
    """The pair's target with a generation config of its own for the test."""
    target, draft = pair
    original = target.generation_config
    target.generation_config = GenerationConfig.from_dict(original.to_dict())
    yield target, draft
    target.generation_config = original


def plain(target) -> list[int]:
    return target.generate(IDS, max_new_tokens=NEW_TOKENS, do_sample=False)[0].tolist()


def test_a_passed_generation_config_runs_specexec_with_its_budget_and_fills_specexec_stats(pair):
    target, draft = pair
    config = GenerationConfig(
        speculator="specexec", budget=4, min_draft_gain=0.0, max_new_tokens=NEW_TOKENS, do_sample=False
    )
    stats = SpecExecStats()
    got = target.generate(IDS, generation_config=config, assistant_model=draft, specexec_stats=stats)
    assert got[0].tolist() == plain(target)
    assert stats.steps and max(step.tree_size for step in stats.steps) == 4 + 1


def test_the_models_generation_config_runs_specexec(fresh_target):
    target, draft = fresh_target
    expected = plain(target)
    target.generation_config.speculator, target.generation_config.max_depth = "specexec", 2
    stats = SpecExecStats()
    got = target.generate(IDS, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=draft, specexec_stats=stats)
    assert got[0].tolist() == expected
    assert max(step.accepted for step in stats.steps) == 2 + 1  # a perfect draft, trees two levels deep


def test_a_saved_generation_config_json_runs_specexec(fresh_target, tmp_path):
    target, draft = fresh_target
    expected = plain(target)
    # A config of its own: one transformers derived from the model's config (_from_model_config) drops custom fields
    # when it is loaded again.
    target.generation_config = GenerationConfig(speculator="specexec", budget=3, min_draft_gain=0.0)
    target.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="sdpa").eval()
    assert loaded.generation_config.speculator == "specexec" and loaded.generation_config.budget == 3
    stats = SpecExecStats()
    got = loaded.generate(IDS, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=draft, specexec_stats=stats)
    assert got[0].tolist() == expected
    assert max(step.tree_size for step in stats.steps) == 3 + 1


def decoder_settings(monkeypatch, target, draft, **kwargs) -> tuple[SpecExecConfig, object, object, str]:
    """The SpecExec config, tree policy, intermediate and draft_graphs mode one ``generate()`` call built its decoder
    with."""
    seen = []

    def spy(
        model, draft_model, request, config, tree_search, state, processors, generation_config, graphs, intermediate
    ):
        seen.append((config, tree_search, intermediate, graphs))
        raise RuntimeError("seen")

    monkeypatch.setattr(generation, "_decoder", spy)
    with pytest.raises(RuntimeError, match="seen"):
        target.generate(IDS, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=draft, **kwargs)
    return seen[0]


def test_every_setting_of_the_generation_config_reaches_the_decoder(pair, monkeypatch):
    target, draft = pair
    # A draft hierarchy (draft_budget sizes its draft's tree) runs without draft_ahead.
    configured = {**CONFIGURED, "draft_ahead": False}
    config = GenerationConfig(speculator="specexec", **configured)
    built, policy, intermediate, graphs = decoder_settings(
        monkeypatch, target, draft, generation_config=config, intermediate_model="self:exit:1"
    )
    assert graphs == CONFIGURED["draft_graphs"]
    assert built == SpecExecConfig(**{name: value for name, value in configured.items() if name not in OTHER_SETTINGS})
    assert type(policy).__name__ == "SpecInferSearch"
    assert intermediate.draft_budget == CONFIGURED["draft_budget"]


def test_keywords_win_over_the_generation_config(pair, monkeypatch):
    target, draft = pair
    # Without an intermediate model, so without draft_budget.
    without_budget = {name: value for name, value in CONFIGURED.items() if name != "draft_budget"}
    config = GenerationConfig(speculator="specexec", **without_budget)
    knobs = {name: value for name, value in KEYWORDS.items() if name not in OTHER_SETTINGS}
    built, policy, _, graphs = decoder_settings(
        monkeypatch, target, draft, generation_config=config, tree_search=KEYWORDS["tree_search"],
        draft_graphs=KEYWORDS["draft_graphs"], **knobs,
    )
    assert graphs == KEYWORDS["draft_graphs"]
    assert built == SpecExecConfig(**knobs)
    assert type(policy).__name__ == "SequoiaSearch"


@given(
    in_config=st.sets(st.sampled_from(sorted(CONFIGURED))),
    as_keyword=st.sets(st.sampled_from(sorted(CONFIGURED))),
    config_object=st.booleans(),
)
def test_each_setting_is_the_keyword_else_the_config_object_else_the_generation_config(
    in_config, as_keyword, config_object
):
    generation_config = GenerationConfig(**{name: CONFIGURED[name] for name in in_config})
    keywords = {name: KEYWORDS[name] if name in as_keyword else None for name in CONFIGURED}
    specexec_config = SpecExecConfig(budget=11, max_branch=9) if config_object else None
    built, others = specexec_settings(generation_config, specexec_config, keywords)
    base = specexec_config or SpecExecConfig()
    for name in CONFIGURED:
        if name in as_keyword:
            expected = KEYWORDS[name]
        elif name in OTHER_SETTINGS:
            expected = CONFIGURED[name] if name in in_config else None
        elif name in in_config and not config_object:
            expected = CONFIGURED[name]
        else:
            expected = getattr(base, name)
        assert (others[name] if name in OTHER_SETTINGS else getattr(built, name)) == expected, name


def test_the_speculator_keyword_wins_over_the_generation_config(fresh_target):
    target, _ = fresh_target
    expected = plain(target)
    target.generation_config.speculator = "specexec"
    # speculator=None, as a keyword or as the passed config's field: plain decoding, which needs no draft.
    assert target.generate(IDS, max_new_tokens=NEW_TOKENS, do_sample=False, speculator=None)[0].tolist() == expected
    config = GenerationConfig(speculator=None, max_new_tokens=NEW_TOKENS, do_sample=False)
    assert target.generate(IDS, generation_config=config)[0].tolist() == expected


def test_assisted_generation_runs_under_a_generation_config_speculator_turned_off(fresh_target):
    """transformers' assisted generation drafts with ``assistant.generate()`` under a copy of the target call's
    config, which names the speculator: that drafting call is never SpecExec's."""
    target, draft = fresh_target
    expected = plain(target)
    target.generation_config.speculator = "specexec"
    got = target.generate(IDS, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=draft, speculator=None)
    assert got[0].tolist() == expected


def test_a_generation_config_speculator_without_a_draft_is_refused_naming_the_config(fresh_target):
    target, _ = fresh_target
    target.generation_config.speculator = "specexec"
    with pytest.raises(ValueError, match=r"set by the generation config's speculator field\) needs a draft"):
        target.generate(IDS, max_new_tokens=3)
    target.generation_config.speculator = "medusa"
    with pytest.raises(ValueError, match=r"Unknown speculator='medusa' \(set by the generation config"):
        target.generate(IDS, max_new_tokens=3)


@pytest.mark.parametrize("setting", [
    {"num_assistant_tokens": 5}, {"num_assistant_tokens_schedule": "heuristic"}, {"prompt_lookup_num_tokens": 3},
    {"assistant_confidence_threshold": 0.2},
])
def test_assisted_generation_settings_with_specexec_warn_by_name(pair, setting):
    target, draft = pair
    ((name, value),) = setting.items()
    with pytest.warns(UserWarning, match=rf"SpecExec does not use {name}={value!r}") as caught:
        got = target.generate(
            IDS, max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=draft, speculator="specexec", **setting
        )
    assert got[0].tolist() == plain(target)
    assert len([each for each in caught if "SpecExec does not use" in str(each.message)]) == 1


def test_no_warning_without_assisted_generation_settings(pair):
    target, draft = pair
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        target.generate(IDS, max_new_tokens=4, do_sample=False, assistant_model=draft, speculator="specexec")
    assert not [each for each in caught if "SpecExec does not use" in str(each.message)]


def test_a_pipeline_runs_specexec_from_the_models_generation_config(fresh_target):
    target, draft = fresh_target
    generator = pipeline("text-generation", model=target, tokenizer=tiny_tokenizer())
    expected = generator("hello there", max_new_tokens=NEW_TOKENS, do_sample=False)
    target.generation_config.update(speculator="specexec", budget=4, min_draft_gain=0.0, allow_custom_entries=True)
    generator = pipeline("text-generation", model=target, tokenizer=tiny_tokenizer())
    stats = SpecExecStats()
    got = generator(
        "hello there", max_new_tokens=NEW_TOKENS, do_sample=False, assistant_model=draft, specexec_stats=stats
    )
    assert got == expected
    assert stats.steps and max(step.tree_size for step in stats.steps) == 4 + 1


def test_a_pipeline_batch_under_a_generation_config_speculator_equals_the_plain_pipeline(pair):
    """A pipeline batch (batch_size=2) takes SpecExec's settings from the call's generation config like a single
    prompt does, and returns what the plain pipeline returns for that batch."""
    target, draft = pair
    generator = pipeline("text-generation", model=target, tokenizer=tiny_tokenizer())
    prompts = ["hello there", "good morning to you"]
    plain = generator(prompts, batch_size=2, max_new_tokens=6, do_sample=False)
    stats = SpecExecStats()
    config = GenerationConfig(max_new_tokens=6, do_sample=False, speculator="specexec", budget=5)
    got = generator(
        prompts, batch_size=2, generation_config=config, assistant_model=draft, specexec_stats=stats,
    )
    assert got == plain
    assert stats.steps and max(step.tree_size for step in stats.steps) <= 2 * (5 + 1)


def test_the_masked_token_probe_decodes_plainly_under_a_generation_config_speculator(monkeypatch):
    """An architecture outside the verified ones is probed with plain generate(), whatever its config names."""
    from specexec_hf.hf import compat

    monkeypatch.setattr(compat, "_probe_verdicts", {})
    target = tiny_model("gemma2", seed=4)
    draft = perturbed_copy(target, 0.05, seed=5)
    mask = torch.tensor([[1, 0, 1, 1]])
    expected = target.generate(IDS, attention_mask=mask, max_new_tokens=6, do_sample=False)
    target.generation_config.speculator = "specexec"
    got = target.generate(IDS, attention_mask=mask, max_new_tokens=6, do_sample=False, assistant_model=draft)
    assert got.tolist() == expected.tolist()
    assert specexec_hf.generate is not None


@pytest.mark.parametrize("route", ["keyword", "generation_config"])
def test_draft_graphs_reaches_the_drafter_from_a_keyword_and_from_the_generation_config(route):
    """draft_graphs='on' asks for the static draft cache: a sliding-window draft, which it cannot hold, is refused
    naming the reason, whichever way the setting came; an unknown mode is refused naming the modes."""
    target = tiny_model("mistral_sliding", seed=0, dtype=torch.float32)
    draft = perturbed_copy(target, 0.05, seed=1)
    for mode, refusal in (("on", r"draft_graphs='on' needs a static draft cache.*sliding"), ("always", "one of")):
        setting = {"draft_graphs": mode}
        kwargs = setting if route == "keyword" else {"generation_config": GenerationConfig(**setting)}
        with pytest.raises(ValueError, match=refusal):
            target.generate(
                IDS, max_new_tokens=4, do_sample=False, assistant_model=draft, speculator="specexec", **kwargs
            )
