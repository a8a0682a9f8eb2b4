"""`custom_generate=specexec_hf.generate` without the `generate()` patch: the draft arrives whether it is given as
`assistant_model=` (transformers' own argument, which it keeps from custom_generate callables) or `draft_model=`."""

from __future__ import annotations

import pytest
import torch

import specexec_hf
from specexec_hf.patches import transformers_generate

NEW_TOKENS = 12
PROMPT = torch.tensor([[1, 5, 9, 2]])


@pytest.fixture
def unpatched():
    transformers_generate.revert()
    try:
        yield
    finally:
        transformers_generate.apply()


def patch_free_specexec(target, **draft) -> list[list[int]]:
    """Greedy SpecExec through transformers' own custom_generate hook."""
    output = target.generate(
        input_ids=PROMPT, custom_generate=specexec_hf.generate, max_new_tokens=NEW_TOKENS, do_sample=False, **draft
    )
    return output.tolist()


def plain_greedy(target) -> list[list[int]]:
    return target.generate(input_ids=PROMPT, max_new_tokens=NEW_TOKENS, do_sample=False).tolist()


@pytest.mark.parametrize("keyword", ["assistant_model", "draft_model"])
def test_custom_generate_takes_the_draft_by_either_name(llama_pair, unpatched, keyword):
    target, draft = llama_pair
    assert patch_free_specexec(target, **{keyword: draft}) == plain_greedy(target)


def test_custom_generate_takes_a_self_draft_by_name(llama_pair, unpatched):
    target, _ = llama_pair
    assert patch_free_specexec(target, assistant_model="self:exit:1") == plain_greedy(target)


def test_without_a_draft_the_error_names_both_arguments(llama_pair, unpatched):
    target, _ = llama_pair
    with pytest.raises(ValueError, match=r"pass assistant_model=.*or draft_model="):
        patch_free_specexec(target)
