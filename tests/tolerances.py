"""How closely two floating-point results must agree in this suite, derived in this one place.

Every float comparison of the suite is one of two kinds.

**The same computation: bit-equal.** Where both results come from literally the same operations on the same
shapes (an offloading executor against the in-memory model it streams, a tensor against its round trip through a
file, one seeded draw against another), they must be identical: compare with ``torch.equal``, never with a
tolerance. Tokens, tree shapes and parents are integers and are always compared exactly.

**The same mathematics through other kernels: equal up to rounding.** SpecExec verifies a whole tree in one
forward where plain ``generate()`` feeds one token at a time; a batched draft forward computes rows that single
forwards compute alone; a subset head multiplies by fewer rows of the same matrix; a head applied to one row
instead of nine. The mathematics are the same, the kernels are not: other tile shapes, other vector-lane and thread
splits, masked keys that add exact zeros to a softmax's sum but shift the lanes it is summed in. Which order each
kernel sums in depends on the CPU (AVX2, AVX-512, ...), on ``ATEN_CPU_CAPABILITY`` and on the thread count, so such
results agree only up to rounding, and only a bound derived from the computation holds on every machine:

- A sum of K terms, in whatever order, is off by at most about K * eps * sum|terms| (the worst case: Higham,
  *Accuracy and Stability of Numerical Algorithms*, section 4.2), and by about sqrt(K) * eps * sum|terms| when the
  roundings have random signs, as they do here; two orders differ by as much again.
- A transformer layer is a handful of such sums (projections over the hidden size, the MLP over its intermediate
  size, attention over the keys, the norms), and what one layer gets wrong passes through the later ones with a
  gain of order one (the norms keep magnitudes in check): over L layers and the head the differences add up to
  about (L + 1) * sqrt(K) * eps * |values|, K the widest of those sums.
- ``eps`` is that of the lowest precision on the path: transformers' eager attention takes its softmax in float32
  even in a float64 model, so eager attention weights, and the hidden states and logits computed from them, carry
  float32 rounding (``compute_dtype``).
- ``|values|`` is the magnitude of what was summed, measured as the largest finite entry of the compared row (the
  last dimension): logits and hidden states are scaled by their own size, attention probabilities lie in [0, 1].
  An entry near zero is a sum of larger terms that cancelled and carries their rounding, so the bound is relative
  to the row's magnitude, not to the entry.
- ``SAFETY`` covers what the sqrt(K) estimate leaves out: the several sums per layer, and the largest of up to
  about a million compared entries of a roughly Gaussian error (about five standard deviations).

So ``bound = SAFETY * depth * sqrt(K) * eps``, relative to each row's magnitude (``rounding_bound``, ``model_bound``,
``assert_close_across_kernels``). For ``conftest.tiny_model`` (float64, 2 layers, K = 64) it is 4e-14, with eager
attention (float32 softmax) 2.3e-5; for the architecture matrix's float32 models 3e-5 to 8e-5. The differences the
suite's comparisons actually see stay within 4% of it (the full architecture matrix included), 13% for float32
paged attention against a float64 reference, measured with the AVX-512, AVX2 and scalar kernels
(``ATEN_CPU_CAPABILITY=avx512|avx2|default``) and with one thread or two. A real bug moves results far
past it: a key wrongly seen moves the tiny models' logits by about 40% of their magnitude, a token placed one
position off by about 0.1% (40 times the eager bound, 1e10 times the float64 one); ``tests/test_tolerances.py``
checks both are caught.
"""

from __future__ import annotations

import math

import torch

SAFETY = 8.0


def rounding_bound(dtype: torch.dtype, reduction: int, depth: int = 1) -> float:
    """How far, relative to the magnitude of the values, two kernel paths of one computation may differ.

    Args:
        dtype: the lowest floating-point precision the computation runs in.
        reduction: the number of terms of its widest sum (a dot product's length, a softmax's keys).
        depth: how many such sums follow one another (a model: its layers and the head).
    """
    if reduction < 1 or depth < 1:
        raise ValueError(f"reduction and depth count terms and steps, so both are >= 1 (got {reduction}, {depth})")
    return SAFETY * depth * math.sqrt(reduction) * torch.finfo(dtype).eps


def compute_dtype(model: torch.nn.Module) -> torch.dtype:
    """The lowest precision a forward of ``model`` runs in: its parameters', and float32 where its attention is
    transformers' eager one (whose softmax runs in float32 whatever the model's dtype)."""
    dtypes = {parameter.dtype for parameter in model.parameters() if parameter.is_floating_point()}
    if model.config._attn_implementation == "eager":
        dtypes.add(torch.float32)
    return max(dtypes, key=lambda dtype: torch.finfo(dtype).eps)


def model_bound(model: torch.nn.Module, keys: int) -> float:
    """``rounding_bound`` for what ``model`` computes (logits, scores, hidden states, attention weights, cached keys
    and values) through two kernel paths.

    Args:
        model: the model both results come from.
        keys: the longest sequence any position attended to (for generate(): the final sequence length).

    The widest sum is taken as the largest dimension of any weight but lookup tables (embeddings) and the head
    (whose sum runs over the hidden size, which other weights have too; an output dimension counted as well only
    loosens the bound) or ``keys``; the depth as the longest stack of modules (the decoder layers) plus the head.
    """
    lookups = {id(module.weight) for module in model.modules() if isinstance(module, torch.nn.Embedding)}
    lookups.add(id(model.get_output_embeddings().weight))
    weights = [parameter for parameter in model.parameters() if parameter.dim() >= 2 and id(parameter) not in lookups]
    widest = max((size for weight in weights for size in weight.shape), default=1)
    layers = max((len(stack) for stack in model.modules() if isinstance(stack, torch.nn.ModuleList)), default=0)
    return rounding_bound(compute_dtype(model), max(widest, keys), depth=layers + 1)


def assert_close_across_kernels(
    actual: torch.Tensor, expected: torch.Tensor, bound: float, msg: str | None = None
) -> None:
    """``actual`` equals ``expected`` within ``bound`` times the magnitude of each row (the last dimension: the
    largest finite ``|expected|`` there), infinities in the same places; shapes and dtypes must match."""
    finite = torch.where(torch.isfinite(expected), expected, torch.zeros_like(expected)).abs()
    magnitude = (finite.amax(dim=-1, keepdim=True) if expected.dim() else finite).clamp_min(
        torch.finfo(expected.dtype).tiny
    )
    prefix = f"{msg}: " if msg else ""
    torch.testing.assert_close(
        actual / magnitude,
        expected / magnitude,
        rtol=0.0,
        atol=bound,
        msg=lambda report: f"{prefix}{report}\n(differences relative to each row's largest |expected|)",
    )
