"""Tiny random causal LMs built in-process, and hypothesis profiles for local runs and CI."""

from __future__ import annotations

import copy
import importlib
import importlib.util
import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from transformers import (
    Gemma2Config,
    Gemma2ForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)


def importable(name: str) -> bool:
    """Whether module ``name`` is installed; ``find_spec("optimum.quanto")`` itself raises when ``optimum`` is not.

    Args:
        name: A dotted module name.
    """
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


# Tiny models gain nothing from intra-op threads, and on a shared 2-core machine the threads' spin-waits
# cost up to 40x.
torch.set_num_threads(1)

settings.register_profile(
    "default", max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True
)
settings.register_profile("thorough", max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

CUDA_AVAILABLE = torch.cuda.is_available()
# Parametrize a test with `@pytest.mark.parametrize("device", DEVICES)`: it always runs on the CPU, and on CUDA
# too where a GPU is present and `-m cuda` selects the CUDA cases (the markers: pyproject.toml).
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """CUDA-marked tests selected on a machine without a GPU skip with the reason instead of failing."""
    if CUDA_AVAILABLE:
        return
    no_cuda = pytest.mark.skip(reason="needs a CUDA GPU: torch.cuda.is_available() is False on this machine")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(no_cuda)


ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {}),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, {"head_dim": 8}),
    # Windows far shorter than prompt + generation, so trees cross them (positions, not cache slots, count).
    "mistral_sliding": (MistralConfig, MistralForCausalLM, {"sliding_window": 5}),
    "qwen2_hybrid": (
        Qwen2Config,
        Qwen2ForCausalLM,
        {"use_sliding_window": True, "sliding_window": 4, "layer_types": ["sliding_attention", "full_attention"]},
    ),
    "gemma2": (Gemma2Config, Gemma2ForCausalLM, {"sliding_window": 4, "head_dim": 8}),
}


def tiny_model(
    arch: str = "llama",
    seed: int = 0,
    vocab_size: int = 64,
    num_layers: int = 2,
    sharpness: float = 4.0,
    dtype: torch.dtype = torch.float64,
    attn_implementation: str = "sdpa",
):
    """A random causal LM small enough for property tests.

    float64 keeps the tree forward and the plain forward numerically equal to far below any argmax gap, so
    greedy equality tests compare algorithms, not rounding. ``sharpness`` scales the output head so that
    next-token distributions are peaked like a trained model's rather than near-uniform.
    """
    config_class, model_class, extra = ARCHITECTURES[arch]
    config = config_class(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=None,
        pad_token_id=None,
        attn_implementation=attn_implementation,
        **extra,
    )
    torch.manual_seed(seed)
    model = model_class(config).to(dtype).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(sharpness)
    model.generation_config.pad_token_id = None
    model.generation_config.eos_token_id = None
    return model


def perturbed_copy(model, noise: float, seed: int):
    """A draft that agrees with ``model`` more the smaller ``noise`` is (0: an exact copy)."""
    draft = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(noise * torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype))
    return draft


@pytest.fixture(scope="session")
def llama_pair():
    target = tiny_model("llama", seed=0)
    return target, perturbed_copy(target, 0.05, seed=1)


def on_device(device: str, *tensors_or_models):
    """The given models and tensors moved to ``device`` (built on the CPU first, so seeds give the same weights)."""
    moved = tuple(item.to(device) for item in tensors_or_models)
    return moved[0] if len(moved) == 1 else moved


CHARACTERS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789 .,!?"


def tiny_tokenizer(vocab_size: int = 64):
    """A character-level fast tokenizer over the first ``vocab_size`` characters of ``CHARACTERS``."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {char: index for index, char in enumerate(CHARACTERS[: vocab_size - 1])}
    vocab["<eos>"] = vocab_size - 1
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", pad_token="<eos>")


def chi_square_p(counts: dict, distribution: dict) -> float:
    """p-value of sampled ``counts`` under ``distribution``, pooling outcomes expected fewer than 5 times."""
    from scipy.stats import chisquare

    samples = sum(counts.values())
    observed, expected, pooled_observed, pooled_expected = [], [], 0, 0.0
    for outcome, probability in distribution.items():
        if probability * samples >= 5:
            observed.append(counts.get(outcome, 0))
            expected.append(probability * samples)
        else:
            pooled_observed += counts.get(outcome, 0)
            pooled_expected += probability * samples
    if pooled_expected > 0:
        observed.append(pooled_observed)
        expected.append(pooled_expected)
    total = sum(expected)
    return float(chisquare(observed, [e * samples / total for e in expected]).pvalue)


@pytest.fixture(scope="module")
def vllm_env():
    """vLLM's environment for the engines a module starts; skips the module without vLLM."""
    pytest.importorskip("vllm")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM-CPU otherwise reserves a large share of RAM
        patch.setenv("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # lets collective_rpc ship the tests' probes
        yield
