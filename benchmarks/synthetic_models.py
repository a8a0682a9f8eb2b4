"""Tiny target/draft pairs made on the spot, for vLLM tests and benchmarks on machines without model downloads.

The target is a random 2-layer Llama whose output layer is scaled up so its next-token distributions are
peaked like a trained LM's (a plain random init gives near-uniform ones, where no draft can agree with it).
The draft is the target with Gaussian noise on every weight: it agrees with the target often but not always,
so both accepted and rejected proposals occur. Head size 32 because vLLM's CPU attention needs >= 32.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "speculative decoding lets a small draft model propose tokens that a large target model verifies",
    "a token tree grows by best first search over the cumulative log probability of the draft",
]


@dataclass(frozen=True)
class TinyPair:
    """Directories of a saved synthetic target and its drafts, each with the shared tokenizer.

    Args:
        target: The target model.
        draft: The target plus noise.
        wrong_vocab_draft: A draft whose vocabulary is larger than the target's.
    """

    target: Path
    draft: Path
    wrong_vocab_draft: Path


def _tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE of about 300 tokens trained on ``CORPUS``; ids 0 and 1 are ``<s>`` and ``</s>``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), special_tokens=["<s>", "</s>"]
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>")


def _config(vocab_size: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=512,
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )


def make_tiny_pair(directory: Path, noise: float = 0.5, sharpness: float = 30.0, seed: int = 0) -> TinyPair:
    """Saves a synthetic target, a noisy-copy draft and a wrong-vocabulary draft under ``directory``.

    Args:
        directory: Where the three model folders go.
        noise: Standard deviation of the draft's weight noise, relative to each weight tensor's own.
        sharpness: Factor on the target's output layer; larger makes next-token distributions more peaked.
        seed: Seed of the random weights.
    """
    directory = Path(directory)
    tokenizer = _tokenizer()
    torch.manual_seed(seed)
    target = LlamaForCausalLM(_config(len(tokenizer)))
    with torch.no_grad():
        target.lm_head.weight.mul_(sharpness)
    draft = LlamaForCausalLM(_config(len(tokenizer)))
    draft.load_state_dict(target.state_dict())
    with torch.no_grad():
        for weight in draft.parameters():
            weight.add_(torch.randn_like(weight) * weight.std() * noise)
    wrong_vocab = LlamaForCausalLM(_config(len(tokenizer) + 32))
    pair = TinyPair(directory / "target", directory / "draft", directory / "wrong_vocab_draft")
    for model, path in ((target, pair.target), (draft, pair.draft), (wrong_vocab, pair.wrong_vocab_draft)):
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)
    return pair
