"""The vLLM subpackage's parts without an engine: paged attention under a tree mask, the KV layout probe, which
requests take trees, the refusals, the proposer's settings and the seams it puts on vLLM."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from conftest import chi_square_p
from hypothesis import given
from hypothesis import strategies as st
from tolerances import assert_close_across_kernels, rounding_bound

from specexec_hf.core.tree import TokenTree

pytest.importorskip("vllm")  # the module imports vLLM below: skipped, not failed, under -m vllm without it

from specexec_hf.patches.patch import UnsupportedRelease
from specexec_hf.vllm import proposer, seams, tree_attention, tree_verifier

pytestmark = pytest.mark.vllm


def _random_tree(parents: list[int]) -> TokenTree:
    tree = TokenTree.from_root(0)
    for parent in parents:
        tree.add_children(torch.tensor([parent]), torch.tensor([1]), torch.zeros(1))
    return tree


@st.composite
def paged_cases(draw):
    nodes = draw(st.integers(1, 12))
    parents = [draw(st.integers(0, node)) for node in range(nodes)]  # node i+1's parent comes before it
    return {
        "parents": parents,
        "prefix": draw(st.integers(0, 90)),
        "block_size": draw(st.sampled_from([32, 64])),
        "kv_heads": draw(st.integers(1, 2)),
        "groups": draw(st.integers(1, 3)),
        "head_size": draw(st.sampled_from([32, 48, 64])),
        "seed": draw(st.integers(0, 2**16)),
    }


@given(paged_cases())
def test_paged_tree_attention_equals_dense_reference(case):
    """KV written by vLLM's own CPU cache writer into shuffled blocks, read back through the block table, attended
    under the [prefix | ancestor] mask: equal to dense attention over the same keys in float64."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    generator = torch.Generator().manual_seed(case["seed"])
    tree = _random_tree(case["parents"])
    prefix, count, block_size = case["prefix"], tree.num_nodes, case["block_size"]
    kv_heads, heads, head_size = case["kv_heads"], case["kv_heads"] * case["groups"], case["head_size"]
    length = prefix + count
    num_blocks = -(-length // block_size) + 2
    keys = torch.randn(length, kv_heads, head_size, generator=generator)
    values = torch.randn(length, kv_heads, head_size, generator=generator)
    query = torch.randn(count - 1, heads, head_size, generator=generator)
    block_ids = torch.randperm(num_blocks, generator=generator)
    slots = block_ids[torch.arange(length) // block_size] * block_size + torch.arange(length) % block_size
    cache = torch.zeros(num_blocks, kv_heads, 2 * block_size, head_size)
    key_cache, value_cache = cache.chunk(2, dim=2)
    isa = _get_attn_isa(torch.float32, block_size, head_size)
    ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)

    visible = tree_attention.tree_rows_mask(tree.ancestor_mask(), prefix)
    gathered_keys, gathered_values = tree_attention.gather_paged_kv(key_cache, value_cache, block_ids, length)
    scale = head_size**-0.5
    got = tree_attention.tree_attention(query, gathered_keys, gathered_values, visible, scale)

    # Dense reference: node i (row i - 1) sees the prefix and the slots of its ancestors and itself.
    expected = torch.empty(count - 1, heads, head_size, dtype=torch.float64)
    ancestors = tree.ancestor_mask()
    for node in range(1, count):
        seen = list(range(prefix)) + [prefix + j for j in range(count) if ancestors[node, j]]
        for head in range(heads):
            k = keys[seen, head // case["groups"]].double()
            v = values[seen, head // case["groups"]].double()
            weights = torch.softmax(query[node - 1, head].double() @ k.T * scale, dim=-1)
            expected[node - 1, head] = weights @ v
    # float32 attention against float64: the rounding of sums over the head size and over the keys.
    bound = rounding_bound(torch.float32, reduction=max(head_size, length))
    assert_close_across_kernels(got.double(), expected, bound)


@st.composite
def step_batches(draw):
    requests = draw(st.integers(1, 4))
    trees = []
    for _ in range(requests):
        nodes = draw(st.integers(1, 8))
        trees.append(([draw(st.integers(0, node)) for node in range(nodes)], draw(st.integers(0, 70))))
    return {"trees": trees, "block_size": draw(st.sampled_from([16, 32])), "seed": draw(st.integers(0, 2**16))}


@given(step_batches())
def test_padded_batch_attends_as_each_request_alone(case):
    """A step's tree requests padded into one attention call per layer (their blocks shuffled in one cache whose
    unused slots hold NaN) give each request's rows what attending over that request alone gives, written to its own
    rows; read_paged_kv reads back each slot the cache writer wrote."""
    from vllm import _custom_ops as ops
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    generator = torch.Generator().manual_seed(case["seed"])
    block_size, kv_heads, heads, head_size = case["block_size"], 2, 6, 32
    trees = [(_random_tree(parents), prefix) for parents, prefix in case["trees"]]
    lengths = [prefix + tree.num_nodes for tree, prefix in trees]
    blocks_each = [-(-length // block_size) for length in lengths]
    num_blocks = sum(blocks_each) + 1
    order = torch.randperm(num_blocks, generator=generator)
    cache = torch.full((num_blocks, kv_heads, 2 * block_size, head_size), float("nan"))
    key_cache, value_cache = cache.chunk(2, dim=2)
    table = torch.zeros(len(trees), max(blocks_each) + 1, dtype=torch.int32)
    starts, visible, slots_each = [], [], []
    used, start = 0, 0
    isa = _get_attn_isa(torch.float32, block_size, head_size)
    for index, ((tree, prefix), length, count) in enumerate(zip(trees, lengths, blocks_each)):
        table[index, :count] = order[used : used + count]
        used += count
        positions = torch.arange(length)
        slots = table[index, positions // block_size].long() * block_size + positions % block_size
        keys = torch.randn(length, kv_heads, head_size, generator=generator)
        values = torch.randn(length, kv_heads, head_size, generator=generator)
        ops.cpu_attn_reshape_and_cache(keys, values, key_cache, value_cache, slots, isa)
        read_keys, read_values = tree_attention.read_paged_kv(key_cache, value_cache, slots)
        assert torch.equal(read_keys, keys) and torch.equal(read_values, values)
        starts.append(start)
        visible.append(tree_attention.tree_rows_mask(tree.ancestor_mask(), prefix))
        slots_each.append(slots)
        start += tree.num_nodes + 1  # a non-tree row between requests, which the batch must not write
    query = torch.randn(start, heads, head_size, generator=generator)
    scale = head_size**-0.5
    padded = tree_attention.pad_tree_rows(starts, visible, table, block_size)
    keys, values = tree_attention.gather_paged_kv(key_cache, value_cache, padded.blocks, padded.length)
    if padded.beyond is not None:
        keys, values = keys.masked_fill(padded.beyond, 0), values.masked_fill(padded.beyond, 0)
    got = tree_attention.tree_attention(query[padded.query_rows], keys, values, padded.visible, scale)
    got = got.flatten(0, 1)[padded.kept]
    expected_rows = []
    for index, ((tree, _), length) in enumerate(zip(trees, lengths)):
        alone_keys, alone_values = tree_attention.gather_paged_kv(key_cache, value_cache, table[index], length)
        rows = slice(starts[index] + 1, starts[index] + tree.num_nodes)
        alone = tree_attention.tree_attention(query[rows], alone_keys, alone_values, visible[index], scale)
        expected_rows.append(alone)
    expected = torch.cat(expected_rows)
    assert padded.output_rows.tolist() == [
        row for first, (tree, _) in zip(starts, trees) for row in range(first + 1, first + tree.num_nodes)
    ]
    assert not got.isnan().any()
    bound = rounding_bound(torch.float32, reduction=max(head_size, max(lengths)))
    assert_close_across_kernels(got.double(), expected.double(), bound)


def test_tree_rows_mask_sees_prefix_ancestors_and_self():
    tree = _random_tree([0, 0, 1, 2])  # root -> 1, 2; 1 -> 3; 2 -> 4
    visible = tree_attention.tree_rows_mask(tree.ancestor_mask(), prefix_length=2)
    assert visible.tolist() == [
        [True, True, True, True, False, False, False],  # node 1: prefix, root, itself
        [True, True, True, False, True, False, False],  # node 2: not its sibling 1
        [True, True, True, True, False, True, False],  # node 3: root, 1, itself
        [True, True, True, False, True, False, True],  # node 4: root, 2, itself
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [32, 128])
def test_kv_layout_probe_accepts_this_backend(dtype, block_size):
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(dtype, block_size, 64)
    if isa == "amx":
        pytest.skip("AMX stores bfloat16 KV in tiles the patch does not read; the probe refuses it (see below)")
    tree_attention.probe_kv_layout(isa, dtype, block_size, 64)


def test_kv_layout_probe_refuses_a_layout_it_cannot_read(monkeypatch):
    # A cache writer that stores keys untransposed stands in for an ISA whose layout the patch does not read.
    from vllm import _custom_ops as ops

    def plain_writer(key, value, key_cache, value_cache, slots, isa, *args):
        block_size = key_cache.shape[2]
        key_cache[slots // block_size, :, slots % block_size] = key
        value_cache[slots // block_size, :, slots % block_size] = value

    monkeypatch.setattr(ops, "cpu_attn_reshape_and_cache", plain_writer)
    with pytest.raises(RuntimeError, match=r"stores KV differently for ISA 'vec'.*set tree_verification=false"):
        tree_attention.probe_kv_layout("vec", torch.float32, 32, 64)


def test_which_requests_take_trees():
    from vllm import SamplingParams

    for params in (
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.7, seed=3),
        SamplingParams(temperature=1.3, top_k=5, top_p=0.8, min_p=0.05),
    ):
        assert tree_verifier.request_takes_tree(params), params
    for params in (
        SamplingParams(temperature=0.0, repetition_penalty=1.2),
        SamplingParams(temperature=0.7, presence_penalty=0.5),
        SamplingParams(temperature=0.0, min_tokens=3),
        SamplingParams(temperature=0.0, logit_bias={3: 1.0}),
        SamplingParams(temperature=0.7, allowed_token_ids=[1, 2]),
        SamplingParams(temperature=0.0, logprobs=2),
    ):
        assert not tree_verifier.request_takes_tree(params), params


def _processed_distribution(logits: torch.Tensor, sampling: tree_verifier.NodeSampling) -> torch.Tensor:
    """The textbook definitions, in float64 and vLLM's order: temperature, min-p, top-k, then top-p over what is left
    (the smallest set of the likeliest tokens holding at least top_p of the mass)."""
    probs = torch.softmax(logits.double() / sampling.temperature, dim=-1)
    keep = probs >= sampling.min_p * probs.max()
    if sampling.top_k:
        keep &= probs >= probs[keep].topk(sampling.top_k).values[-1]
    probs = torch.where(keep, probs, 0) / torch.where(keep, probs, 0).sum()
    ordered, order = probs.sort(descending=True)
    mass_before = ordered.cumsum(0) - ordered
    kept = torch.zeros_like(keep)
    kept[order] = mass_before < sampling.top_p
    probs = torch.where(kept, probs, 0)
    return probs / probs.sum()


@pytest.mark.parametrize(
    "sampling",
    [
        tree_verifier.NodeSampling(temperature=1.0),
        tree_verifier.NodeSampling(temperature=0.6, top_k=4),
        tree_verifier.NodeSampling(temperature=1.5, top_p=0.7),
        tree_verifier.NodeSampling(temperature=1.2, top_k=6, top_p=0.9, min_p=0.05),
    ],
)
def test_node_choices_draw_from_the_processed_distribution(sampling):
    """Each node's draw follows that node's processed distribution; the same draws fail against the distribution at
    a higher temperature, so the check can fail."""
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 12, generator=generator) * 1.5
    seeded = replace(sampling, generator=torch.Generator().manual_seed(7))
    draws = torch.stack([tree_verifier.node_choices(logits, seeded) for _ in range(3000)])
    for node in range(logits.shape[0]):
        counts = dict(zip(*[t.tolist() for t in draws[:, node].unique(return_counts=True)]))
        expected = dict(enumerate(_processed_distribution(logits[node], sampling).tolist()))
        assert all(expected[token] > 0 for token in counts), "drew a token the processing removes"
        assert chi_square_p(counts, expected) > 1e-3
        hotter = replace(sampling, temperature=2 * sampling.temperature)
        assert chi_square_p(counts, dict(enumerate(_processed_distribution(logits[node], hotter).tolist()))) < 1e-6


def test_node_choices_greedy_and_seeded():
    logits = torch.randn(5, 30, generator=torch.Generator().manual_seed(2))
    assert torch.equal(tree_verifier.node_choices(logits, None), logits.argmax(dim=-1))

    def draws(seed: int) -> torch.Tensor:
        sampling = tree_verifier.NodeSampling(temperature=1.0, generator=torch.Generator().manual_seed(seed))
        return torch.stack([tree_verifier.node_choices(logits, sampling) for _ in range(20)])

    assert torch.equal(draws(5), draws(5))  # a seeded request's draws come from its own generator
    assert not torch.equal(draws(5), draws(6))


@pytest.mark.parametrize("seam", seams.SEAMS, ids=lambda seam: f"{seam.owner}.{seam.name}")
def test_every_seam_matches_the_installed_vllm(seam):
    seam.patch(lambda original: original, "the test", "").check()


def _engine(**changes) -> SimpleNamespace:
    """What check_engine reads: the engine's configuration and its device."""
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(async_scheduling=False),
        parallel_config=SimpleNamespace(pipeline_parallel_size=1, tensor_parallel_size=1),
        model_config=SimpleNamespace(is_hybrid=False, logits_processors=None, uses_mrope=False),
        cache_config=SimpleNamespace(cache_dtype="auto"),
    )
    engine = SimpleNamespace(vllm_config=config, device=torch.device("cpu"))
    for path, value in changes.items():
        target = engine
        *parents, name = path.split(".")
        for parent in parents:
            target = getattr(target, parent)
        setattr(target, name, value)
    return engine


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"vllm_config.scheduler_config.async_scheduling": True}, "async scheduling"),
        ({"vllm_config.parallel_config.pipeline_parallel_size": 2}, "pipeline parallelism"),
        ({"vllm_config.parallel_config.tensor_parallel_size": 2}, "tensor parallelism"),
        ({"vllm_config.model_config.is_hybrid": True}, "hybrid models"),
        ({"vllm_config.model_config.logits_processors": ["x.Y"]}, "custom logits processors"),
        ({"vllm_config.cache_config.cache_dtype": "fp8"}, "quantized KV caches"),
        ({"vllm_config.model_config.uses_mrope": True}, "M-RoPE"),
        ({"device": torch.device("cuda")}, "devices other than the CPU attention backend"),
    ],
)
def test_refusals(change, message):
    tree_verifier.check_engine(**vars(_engine()))
    with pytest.raises(ValueError, match=f"does not support .*{message}"):
        tree_verifier.check_engine(**vars(_engine(**change)))


def _proposer_config(budget: int, num_speculative_tokens: int) -> SimpleNamespace:
    specexec = {"draft_model": "unused", "budget": budget, "tree_verification": True}
    return SimpleNamespace(
        speculative_config=SimpleNamespace(
            num_speculative_tokens=num_speculative_tokens,
            draft_load_config=SimpleNamespace(model_loader_extra_config={"specexec": specexec}),
        ),
        model_config=SimpleNamespace(max_model_len=256, get_vocab_size=lambda: 320, dtype=torch.float32),
        device_config=SimpleNamespace(device="cpu"),
    )


@pytest.fixture
def runner_seams():
    """Reverts the runner seams a proposer built in the test puts on vLLM's model runner class."""
    yield
    proposer.revert()


def test_proposer_needs_num_speculative_tokens_equal_to_the_budget(runner_seams):
    assert proposer.SpecExecProposer(_proposer_config(16, 16)).settings.tree_verification
    with pytest.raises(ValueError, match=r"budget=32 draft tokens.*num_speculative_tokens to the budget \(it is 8\)"):
        proposer.SpecExecProposer(_proposer_config(32, 8))


def test_tree_verification_setting():
    from specexec_hf.vllm.settings import ProposerSettings

    assert not ProposerSettings.from_sources({"draft_model": "d"}, {}).tree_verification
    assert ProposerSettings.from_sources({"draft_model": "d"}, {"SPECEXEC_TREE_VERIFICATION": "true"}).tree_verification
    assert ProposerSettings.from_sources({"draft_model": "d", "tree_verification": True}, {}).tree_verification
    with pytest.raises(ValueError, match="tree_verification='maybe' is not"):
        ProposerSettings.from_sources({"draft_model": "d"}, {"SPECEXEC_TREE_VERIFICATION": "maybe"})


def test_draft_int8_setting():
    from specexec_hf.vllm.settings import ProposerSettings

    assert not ProposerSettings.from_sources({"draft_model": "d"}, {}).draft_int8
    assert ProposerSettings.from_sources({"draft_model": "d"}, {"SPECEXEC_DRAFT_INT8": "1"}).draft_int8
    assert ProposerSettings.from_sources({"draft_model": "d", "draft_int8": True}, {}).draft_int8
    with pytest.raises(ValueError, match="draft_int8='yes' is not"):
        ProposerSettings.from_sources({"draft_model": "d"}, {"SPECEXEC_DRAFT_INT8": "yes"})


def test_draft_vocab_setting(tmp_path):
    """draft_vocab names a JSON list of token ids (JSON or SPECEXEC_DRAFT_VOCAB); unset, the draft folder's
    DRAFT_VOCAB_FILE where there is one; 'all' keeps the whole head; other files are refused, naming the problem."""
    from specexec_hf.vllm.settings import DRAFT_VOCAB_FILE, ProposerSettings, read_token_ids

    vocab = tmp_path / "vocab.json"
    vocab.write_text("[5, 1, 3]")
    assert ProposerSettings.from_sources({"draft_model": "d"}, {}).draft_vocab is None
    assert ProposerSettings.from_sources({"draft_model": str(tmp_path)}, {}).draft_vocab is None
    (tmp_path / DRAFT_VOCAB_FILE).write_text("[2, 4]")
    assert ProposerSettings.from_sources({"draft_model": str(tmp_path)}, {}).draft_vocab == str(
        tmp_path / DRAFT_VOCAB_FILE
    )
    everything = {"draft_model": str(tmp_path), "draft_vocab": "all"}
    assert ProposerSettings.from_sources(everything, {}).draft_vocab is None
    settings = ProposerSettings.from_sources({"draft_model": "d"}, {"SPECEXEC_DRAFT_VOCAB": str(vocab)})
    assert settings.draft_vocab == str(vocab)
    assert read_token_ids(settings.draft_vocab).tolist() == [5, 1, 3]
    with pytest.raises(ValueError, match="is not a file"):
        ProposerSettings.from_sources({"draft_model": "d", "draft_vocab": str(tmp_path / "missing.json")}, {})
    for bad in ("[]", '{"ids": [1]}', "[1, -2]", "[1.5]"):
        vocab.write_text(bad)
        with pytest.raises(ValueError, match="non-empty JSON list of non-negative token ids"):
            read_token_ids(str(vocab))


@pytest.mark.parametrize("avx512_bf16, amx", [(True, False), (False, True), (False, False)])
def test_engine_draft_dtype_is_bfloat16_only_for_a_float32_target_on_a_native_bf16_cpu(monkeypatch, avx512_bf16, amx):
    monkeypatch.delenv("SPECEXEC_NATIVE_BFLOAT16", raising=False)  # CI forces it either way; this test probes
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    native = torch.bfloat16 if avx512_bf16 or amx else torch.float32
    assert proposer.engine_draft_dtype(torch.device("cpu"), torch.float32) == native
    assert proposer.engine_draft_dtype(torch.device("cpu"), torch.float32, draft_int8=True) == torch.float32
    assert proposer.engine_draft_dtype(torch.device("cpu"), torch.float16) == torch.float16
    assert proposer.engine_draft_dtype(torch.device("cuda"), torch.float32) == torch.float32


def test_int8_draft_setting_refuses_a_non_float32_draft_dtype():
    from specexec_hf.vllm.settings import ProposerSettings

    with pytest.raises(ValueError, match=r"draft_int8=true .* float32 activations, not draft_dtype='bfloat16'"):
        ProposerSettings.from_sources({"draft_model": "d", "draft_int8": True, "draft_dtype": "bfloat16"}, {})
    assert ProposerSettings.from_sources({"draft_model": "d", "draft_int8": True, "draft_dtype": "float32"}, {})


RUNNER_METHODS = ("_prepare_inputs", "_sample")


def test_runner_seams_hand_each_runner_to_its_own_proposer_and_revert_exactly(runner_seams):
    """vLLM's custom_class hook never passes the runner: the _prepare_inputs seam hands it to the proposer that is the
    runner's drafter, runners with other drafters run vLLM's methods alone, and revert() restores the class."""
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    native = {name: vars(GPUModelRunner)[name] for name in RUNNER_METHODS}
    ours = proposer.SpecExecProposer(_proposer_config(16, 16))
    assert all(getattr(GPUModelRunner, name) is not native[name] for name in RUNNER_METHODS)
    proposer.apply(tree_verification=True)  # idempotent
    with pytest.raises(RuntimeError, match="before a vLLM V1 model runner prepared a step"):
        ours.propose([[1]], np.array([1]), np.zeros((1, 4), dtype=np.int64))
    ours.tree_verifier = tree_verifier.TreeVerifier()
    calls = []
    prepare = proposer._handing_over_the_runner(lambda runner, *inputs: calls.append(runner) or "prepared")
    sample = proposer._walking_trees(lambda runner, logits, metadata: "sampled")
    nothing_scheduled = SimpleNamespace(scheduled_spec_decode_tokens={})
    other = SimpleNamespace(drafter=object())
    assert prepare(other, nothing_scheduled, np.zeros(0)) == "prepared" and ours.runner is None
    runner = SimpleNamespace(drafter=ours, requests={})
    assert prepare(runner, nothing_scheduled, np.zeros(0)) == "prepared" and ours.runner is runner
    assert calls == [other, runner]
    assert sample(runner, None, None) == "sampled"  # no tree in flight: vLLM's own sampler
    proposer.revert()
    proposer.revert()  # a second revert does nothing
    assert {name: vars(GPUModelRunner)[name] for name in RUNNER_METHODS} == native


def test_a_runner_method_with_another_signature_is_refused_at_engine_start(runner_seams, monkeypatch):
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    def changed(self, scheduler_output):
        raise AssertionError("never called")

    monkeypatch.setattr(GPUModelRunner, "_prepare_inputs", changed)
    refused = r"GPUModelRunner\._prepare_inputs takes \(self, scheduler_output\), but SpecExec's vLLM proposer"
    with pytest.raises(UnsupportedRelease, match=refused):
        proposer.SpecExecProposer(_proposer_config(16, 16))
    assert GPUModelRunner._prepare_inputs is changed


def test_the_attention_seam_is_idempotent_and_reversible():
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

    native_forward = CPUAttentionBackendImpl.forward
    tree_verifier.apply()
    try:
        patched = CPUAttentionBackendImpl.forward
        tree_verifier.apply()
        assert CPUAttentionBackendImpl.forward is patched is not native_forward
    finally:
        tree_verifier.revert()
    assert CPUAttentionBackendImpl.forward is native_forward
    tree_verifier.revert()  # a second revert does nothing


def test_a_one_thread_cpu_worker_on_a_larger_machine_gets_a_binding_hint():
    cpu = torch.device("cpu")
    assert "VLLM_CPU_OMP_THREADS_BIND=0-1 " in proposer.one_thread_hint(cpu, 1, 2, None)
    assert "0-7" in proposer.one_thread_hint(cpu, 1, 8, "auto")
    assert proposer.one_thread_hint(cpu, 2, 2, None) is None  # already every core
    assert proposer.one_thread_hint(cpu, 1, 1, None) is None  # nothing more to give
    assert proposer.one_thread_hint(cpu, 1, 2, "0") is None  # the user chose the binding
    assert proposer.one_thread_hint(torch.device("meta"), 1, 2, None) is None  # not a CPU engine
