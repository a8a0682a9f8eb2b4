"""The architecture matrix: greedy SpecExec equals plain greedy generate(), or refuses and says why.

Every decoder-only causal LM class transformers registers is built tiny from its default config
(``architectures.build_tiny``) and decoded greedily through SpecExec with a prompt shorter and one longer than
any window its config declares. The result must be ``exact`` or ``refused: <reason>``; a silent MISMATCH or a
crash (any error other than ``UnsupportedModelError``) fails.

A fast subset runs in CI. The full matrix is marked ``architectures``, which the default run deselects:
``pytest -m architectures tests/test_architectures.py`` runs it. Its table:
``python tests/architectures.py --table docs/architectures.md``.
"""

from __future__ import annotations

import pytest
from architectures import (
    LONG_PROMPT,
    WINDOW,
    Skip,
    build_tiny,
    causal_lm_model_types,
    classify,
    prompt_lengths,
    tiny_config,
)


def results_for(model_type: str) -> list[tuple[int, str]]:
    """``[(prompt_len, result), ...]`` for a short and a long prompt; skips types outside the matrix."""
    try:
        tiny = build_tiny(model_type)
        return [(n, classify(model_type, n)) for n in prompt_lengths(tiny)]
    except Skip as skip:
        pytest.skip(f"{model_type}: {skip}")


def assert_exact_or_refused(model_type: str, results: list[tuple[int, str]]) -> None:
    bad = [f"prompt {n}: {result}" for n, result in results if not result.startswith(("exact", "refused: "))]
    assert not bad, f"{model_type}: " + "; ".join(bad)
    for n, result in results:
        if result.startswith("refused: "):
            # A refusal names its reason: more than the bare exception.
            assert len(result.removeprefix("refused: ")) > 20, f"{model_type}, prompt {n}: {result!r}"


# --- fast subset (CI) -------------------------------------------------------------------------------------------

EXACT = ["llama", "mistral", "gpt2", "qwen2", "gemma2", "opt", "fuyu"]  # fuyu: generate() adds an empty input
REFUSED = {
    "bloom": "position_ids",  # ALiBi, no position_ids argument
    "qwen3_next": "stateful",  # linear-attention (recurrent) layers
    "gpt_neo": "local-attention",  # local layers whose bias is indexed by cache slot
    "mamba": "stateful",  # recurrent state, no KV cache
    "doge": "tree-attention probe",  # top-k key selection over the cache: the probe goes past keep_window_size
    "bert": "is_decoder=False",  # bidirectional by default: every plain forward lets tokens see later ones
}


@pytest.mark.parametrize("model_type", EXACT)
def test_exact(model_type):
    results = results_for(model_type)
    assert [result for _, result in results] == ["exact"] * len(results), results


@pytest.mark.parametrize("model_type", sorted(REFUSED))
def test_refused_with_reason(model_type):
    results = results_for(model_type)
    assert_exact_or_refused(model_type, results)
    for n, result in results:
        assert result.startswith("refused: ") and REFUSED[model_type] in result, (n, result)


def test_mistral_keeps_its_sliding_window_and_prompts_exceed_it():
    config = tiny_config("mistral")
    assert config.sliding_window == WINDOW
    assert max(prompt_lengths(build_tiny("mistral"))) == LONG_PROMPT > WINDOW


@pytest.mark.parametrize(
    ("model_type", "expected"),
    [
        ("gemma2", {"full_attention", "sliding_attention"}),
        ("gemma3_text", {"full_attention", "sliding_attention"}),
        ("qwen3_next", {"full_attention", "linear_attention"}),
    ],
)
def test_tiny_configs_keep_every_layer_type(model_type, expected):
    config = tiny_config(model_type)
    assert set(config.layer_types) == expected
    assert len(config.layer_types) == config.num_hidden_layers <= 8
    assert config.vocab_size == 128 and config.hidden_size == 64


def test_matrix_lists_every_registered_causal_lm():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    assert causal_lm_model_types() == sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    assert {"llama", "gpt2", "mamba", "gemma3_text"} <= set(causal_lm_model_types())


# --- full matrix (-m architectures) -----------------------------------------------------------------------------


@pytest.mark.architectures
@pytest.mark.parametrize("model_type", causal_lm_model_types())
def test_matrix(model_type):
    """Every registered causal LM: exact, or refused with a reason. MISMATCH and crashes fail (no xfail here)."""
    assert_exact_or_refused(model_type, results_for(model_type))
