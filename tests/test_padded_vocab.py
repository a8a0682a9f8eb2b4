"""Drafts sharing the target's tokenizer with embeddings padded to another size (Qwen2.5-0.5B-Instruct has 151936
rows, Qwen2.5-7B-Instruct 152064): SpecExec runs them exactly, proposing only the ids both models have, and refuses a
draft only where the tokenizers it was given differ."""

from __future__ import annotations

import pytest
import torch
from conftest import chi_square_p, perturbed_copy, tiny_model, tiny_tokenizer
from hypothesis import given
from hypothesis import strategies as st
from test_sampling import PROMPT, exact_distribution, processors
from transformers import LogitsProcessorList

import specexec_hf  # noqa: F401  (installs speculator="specexec")
from specexec_hf import SpecExecStats
from specexec_hf.models.vocab import restrict_draft_vocabulary

BASE_VOCAB = 64  # the ids of the shared tokenizer; rows past it are padding
PADDING_SCALE = 6.0  # padding rows score high: a draft would propose them, and a target emits them


def padded_copy(model, vocab_size: int, noise: float, seed: int):
    """``model`` perturbed by ``noise`` (as ``perturbed_copy``) with its embeddings cut or padded to ``vocab_size``
    rows: the rows both keep are its own, the padding rows random, their output rows scaled by ``PADDING_SCALE``."""
    padded = perturbed_copy(model, noise, seed)
    kept = min(vocab_size, model.config.vocab_size)
    padded.resize_token_embeddings(vocab_size, mean_resizing=False)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for weight, scale in ((padded.get_input_embeddings().weight, 1.0), (padded.lm_head.weight, PADDING_SCALE)):
            rows = weight[kept:]
            rows.copy_(scale * torch.randn(rows.shape, generator=generator, dtype=rows.dtype))
    return padded


def padded_pair(seed: int, target_vocab: int, draft_vocab: int, noise: float, dtype: torch.dtype = torch.float32):
    """A target of ``target_vocab`` ids (its padding rows scaled like ``padded_copy``'s) and a draft close to it
    with ``draft_vocab``."""
    target = padded_copy(tiny_model("llama", seed=seed, vocab_size=BASE_VOCAB, dtype=dtype), target_vocab, 0.0, seed)
    return target, padded_copy(target, draft_vocab, noise, seed + 1)


def greedy_specexec(target, draft, ids, max_new_tokens, **kwargs):
    stats = SpecExecStats()
    got = target.generate(
        ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=draft, speculator="specexec",
        specexec_stats=stats, **kwargs,
    )
    return got[0].tolist(), stats


@given(
    seed=st.integers(0, 2**16),
    sizes=st.tuples(st.integers(0, 24), st.integers(0, 24)).filter(lambda pads: pads[0] != pads[1]),
    noise=st.sampled_from([0.0, 0.05, 0.5]),
    prompt_length=st.integers(1, 10),
    max_new_tokens=st.integers(1, 24),
    budget=st.integers(1, 24),
    subset_head=st.booleans(),
    context_match=st.booleans(),
    draft_ahead=st.booleans(),
    tokenizers=st.sampled_from(["none", "target only", "same object", "equal copies"]),
)
def test_greedy_with_a_padded_draft_equals_plain_greedy(
    seed, sizes, noise, prompt_length, max_new_tokens, budget, subset_head, context_match, draft_ahead, tokenizers
):
    target_vocab, draft_vocab = BASE_VOCAB + sizes[0], BASE_VOCAB + sizes[1]
    target, draft = padded_pair(seed, target_vocab, draft_vocab, noise)
    if subset_head:  # scored columns on both sides of the target's size
        every = torch.randperm(draft_vocab, generator=torch.Generator().manual_seed(seed))
        restrict_draft_vocabulary(draft, every[: draft_vocab // 2])
    ids = torch.randint(0, BASE_VOCAB, (1, prompt_length), generator=torch.Generator().manual_seed(seed))
    given_tokenizers = {
        "none": {},
        "target only": {"tokenizer": tiny_tokenizer()},
        "same object": {"tokenizer": (shared := tiny_tokenizer()), "assistant_tokenizer": shared},
        "equal copies": {"tokenizer": tiny_tokenizer(), "assistant_tokenizer": tiny_tokenizer()},
    }[tokenizers]
    expected = target.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)[0].tolist()
    got, stats = greedy_specexec(
        target, draft, ids, max_new_tokens, budget=budget, draft_ahead=draft_ahead,
        context_match_weights=(0.6, 0.9) if context_match else (), **given_tokenizers,
    )
    # Float32: equal up to the first choice rounding could have flipped (none on these sharp random models).
    certified = ids.shape[1] + (stats.near_tied_positions or [max_new_tokens])[0]
    assert got[:certified] == expected[:certified]
    assert len(got) == len(expected)


def test_a_draft_wider_than_the_target_never_proposes_an_id_the_target_lacks():
    target, draft = padded_pair(seed=3, target_vocab=BASE_VOCAB, draft_vocab=BASE_VOCAB + 16, noise=0.0)
    with torch.no_grad():  # the draft's padding rows outscore every shared id
        draft.lm_head.weight[BASE_VOCAB:] = 100 * draft.lm_head.weight[:1]
    ids = torch.tensor([[1, 2, 3, 4]])
    got, stats = greedy_specexec(target, draft, ids, 12, budget=8)
    assert got == target.generate(ids, max_new_tokens=12, do_sample=False)[0].tolist()
    assert stats.steps and all(step.tree_size > 1 for step in stats.steps)  # trees were grown, of shared ids


def test_a_target_wider_than_the_draft_commits_ids_the_draft_lacks():
    target, draft = padded_pair(seed=5, target_vocab=BASE_VOCAB + 16, draft_vocab=BASE_VOCAB, noise=0.05)
    ids = torch.tensor([[1, 2, 3, 4]])
    expected = target.generate(ids, max_new_tokens=24, do_sample=False)[0].tolist()
    assert any(token >= BASE_VOCAB for token in expected[4:])  # the case at hand: the draft must read past them
    got, _ = greedy_specexec(target, draft, ids, 24, budget=8)
    assert got == expected


VOCAB, SAMPLES = 5, 1500


@pytest.mark.parametrize("draft_vocab", [VOCAB - 1, VOCAB + 2], ids=["narrower draft", "wider draft"])
def test_samples_with_drawn_children_follow_the_targets_distribution(draft_vocab):
    """Drawn children are verified by rejection sampling against the draft's distribution over the target's ids."""
    target = tiny_model("llama", seed=11, vocab_size=VOCAB, sharpness=3.0, dtype=torch.float32)
    draft = padded_copy(target, draft_vocab, 0.3, seed=12)
    settings = {"temperature": 0.7}
    distribution = exact_distribution(target, processors(settings))
    torch.manual_seed(2024)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(SAMPLES):
        out = target.generate(
            PROMPT, do_sample=True, max_new_tokens=2, top_k=None, top_p=None, **settings, assistant_model=draft,
            speculator="specexec", budget=6, max_branch=3, sampled_children=True,
        )
        outcome = tuple(out[0, PROMPT.shape[1] :].tolist())
        counts[outcome] = counts.get(outcome, 0) + 1
    assert chi_square_p(counts, distribution) > 1e-3
    assert chi_square_p(counts, exact_distribution(target, LogitsProcessorList())) < 1e-3


def test_a_draft_with_another_tokenizer_is_refused_naming_the_difference():
    target, draft = padded_pair(seed=1, target_vocab=BASE_VOCAB, draft_vocab=BASE_VOCAB + 8, noise=0.0)
    other = tiny_tokenizer(BASE_VOCAB - 1)  # one character fewer, and its "<eos>" at another id
    with pytest.raises(ValueError, match=r"draft's tokenizer is not the target's: compared by vocabulary") as error:
        greedy_specexec(
            target, draft, torch.tensor([[1, 2]]), 4, tokenizer=tiny_tokenizer(), assistant_tokenizer=other
        )
    assert "the target's token ' ' is id 62, absent from the draft's" in str(error.value)


def test_an_assistant_tokenizer_alone_is_refused():
    target, draft = padded_pair(seed=1, target_vocab=BASE_VOCAB, draft_vocab=BASE_VOCAB + 8, noise=0.0)
    with pytest.raises(ValueError, match="pass tokenizer=<the target's tokenizer> too"):
        greedy_specexec(target, draft, torch.tensor([[1, 2]]), 4, assistant_tokenizer=tiny_tokenizer())
