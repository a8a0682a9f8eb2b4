"""Layer self-drafts (``self:exit:K``, ``self:skip:...``): the target's own layers, shared, as its draft."""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
from accelerate import dispatch_model
from conftest import tiny_model
from hypothesis import given, settings
from hypothesis import strategies as st
from test_batched_drafting import assert_same_tree
from test_cache import assert_cache_prefix_equal, recomputed_cache
from tolerances import model_bound
from transformers import DynamicCache, T5Config, T5ForConditionalGeneration

import specexec_hf
from specexec_hf.models import resolve_draft
from specexec_hf.models.self_draft import SELF_DRAFT_ATTRIBUTE, layer_spec, resident_layers
from specexec_hf.offload import layer_streamer

# Families with full, sliding and mixed attention layers; the hybrid one's layer types are given for 2 layers.
LAYER_COUNTS = {"llama": 4, "mistral_sliding": 4, "qwen2_hybrid": 2, "qwen3": 3}


def prompt(seed: int, length: int = 6) -> torch.Tensor:
    return torch.randint(0, 64, (1, length), generator=torch.Generator().manual_seed(seed))


@st.composite
def layer_drafts(draw) -> tuple[str, str]:
    """A family and a layer self-draft name valid for its tiny model."""
    arch = draw(st.sampled_from(sorted(LAYER_COUNTS)))
    count = LAYER_COUNTS[arch]
    if draw(st.booleans()):
        return arch, f"self:exit:{draw(st.integers(1, count))}"
    skipped = draw(st.sets(st.integers(0, count - 1), min_size=1, max_size=count - 1))
    return arch, "self:skip:" + ",".join(map(str, sorted(skipped)))


@settings(max_examples=12, deadline=None)
@given(drafted=layer_drafts(), seed=st.integers(0, 2**16), budget=st.integers(1, 24))
def test_generation_with_a_layer_self_draft_is_plain_greedy(drafted, seed, budget):
    arch, name = drafted
    target = tiny_model(arch, seed=seed, num_layers=LAYER_COUNTS[arch])
    ids = prompt(seed)
    expected = target.generate(ids, max_new_tokens=20, do_sample=False)
    out = target.generate(ids, max_new_tokens=20, do_sample=False, assistant_model=name, speculator="specexec",
                          budget=budget)
    assert out.tolist() == expected.tolist()


def reference_draft(target, layers: list[int]):
    """A copy of ``target`` holding only decoder ``layers``, renumbered: what a layer self-draft must compute."""
    reference = copy.deepcopy(target)
    reference.config.num_hidden_layers = len(layers)
    if getattr(reference.config, "layer_types", None) is not None:
        reference.config.layer_types = [reference.config.layer_types[i] for i in layers]
    reference.model.layers = torch.nn.ModuleList(reference.model.layers[i] for i in layers)
    for index, layer in enumerate(reference.model.layers):
        layer.self_attn.layer_idx = index
    return reference


@pytest.mark.parametrize("arch", sorted(LAYER_COUNTS))
@pytest.mark.parametrize("spec", ["self:exit:1", "self:skip:0", "self:skip:1"])
def test_a_layer_self_draft_computes_its_layers_alone_and_caches_only_them(arch, spec):
    target = tiny_model(arch, seed=3, num_layers=LAYER_COUNTS[arch])
    _, layers = layer_spec(target, spec)
    draft = resolve_draft(target, spec)
    ids = prompt(3, 9)
    with torch.no_grad():
        expected = reference_draft(target, layers)(ids).logits
        cache = DynamicCache()
        head = draft(ids[:, :5], past_key_values=cache, use_cache=True).logits
        tail = draft(ids[:, 5:], past_key_values=cache, use_cache=True).logits
    torch.testing.assert_close(torch.cat([head, tail], dim=1), expected)
    assert len(cache.layers) == len(layers) and cache.get_seq_length() == ids.shape[1]


def test_the_exit_at_the_last_layer_is_the_target():
    target = tiny_model("llama", seed=4, num_layers=4)
    draft = resolve_draft(target, "self:exit:4")
    ids = prompt(4, 12)
    with torch.no_grad():
        assert torch.equal(draft(ids).logits, target(ids).logits)
    stats = specexec_hf.SpecExecStats()
    target.generate(ids, max_new_tokens=24, do_sample=False, assistant_model=draft, speculator="specexec", budget=16,
                    specexec_stats=stats)
    assert stats.tokens_per_target_forward > 4  # a draft equal to the target: its trees are accepted deep


@pytest.mark.parametrize("spec", ["self:exit:2", "self:skip:1-2"])
def test_a_layer_self_draft_shares_the_targets_weights(spec):
    target = tiny_model("llama", seed=5, num_layers=4)
    before = {name: tensor.clone() for name, tensor in target.state_dict().items()}
    draft = resolve_draft(target, spec)
    pointers = {tensor.data_ptr() for tensor in target.state_dict().values()}
    assert draft.state_dict() and all(tensor.data_ptr() in pointers for tensor in draft.state_dict().values())
    _, layers = layer_spec(target, spec)
    assert [shared.layer for shared in draft.model.layers] == [target.model.layers[i] for i in layers]
    assert draft.lm_head is target.lm_head and draft.model.embed_tokens is target.model.embed_tokens
    assert draft.model.norm is target.model.norm
    assert all(torch.equal(before[name], tensor) for name, tensor in target.state_dict().items())
    assert getattr(draft.config, SELF_DRAFT_ATTRIBUTE) == spec
    assert target.config.num_hidden_layers == 4 and not hasattr(target.config, SELF_DRAFT_ATTRIBUTE)


def test_each_layer_self_draft_is_built_once_under_its_canonical_name():
    target = tiny_model("llama", seed=6, num_layers=4)
    assert resolve_draft(target, "self:exit") is resolve_draft(target, "self:exit:2")  # in memory: the first half
    assert resolve_draft(target, "self:skip:2,1") is resolve_draft(target, "self:skip:1-2")
    assert resolve_draft(target, "self:skip") is resolve_draft(target, "self:skip:1-2")  # the middle half
    assert resolve_draft(target, "self:exit:3") is not resolve_draft(target, "self:exit:2")


@pytest.mark.parametrize(("spec", "message"), [
    ("self:exit:0", "from 1 to 4.*self:exit:2"),
    ("self:exit:5", "from 1 to 4"),
    ("self:exit:two", "whole number"),
    ("self:exit:", "whole number"),
    ("self:skip:", "names no layer to skip"),
    ("self:skip:0-3", "skips all 4 decoder layers"),
    ("self:skip:4", "outside 0-3"),
    ("self:skip:3-1", "reversed"),
    ("self:skip:1;2", "not a layer index"),
    ("self:exits:2", "self:exit:K"),
])
def test_bad_layer_specs_name_the_fix(spec, message):
    with pytest.raises(ValueError, match=message):
        resolve_draft(tiny_model("llama", num_layers=4), spec)


def test_a_model_without_decoder_layers_is_refused():
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=32, d_ff=64, num_layers=2, num_heads=4, d_kv=8))
    with pytest.raises(ValueError, match="decoder-only.*separate draft model"):
        resolve_draft(t5, "self:exit:1")


# Decoder layers 1 and 3 on disk; the embedding, norm and head in RAM.
PLACEMENT = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.layers.2": "cpu",
             "model.layers.3": "disk", "model.norm": "cpu", "lm_head": "cpu", "model.rotary_emb": "cpu"}


@pytest.mark.parametrize("executor", ["accelerate", "stream"])
def test_on_an_offloaded_target_the_default_layers_are_the_resident_ones(executor):
    target = tiny_model("llama", seed=7, num_layers=4)
    ids = prompt(7)
    expected = target.generate(ids, max_new_tokens=16, do_sample=False)
    with tempfile.TemporaryDirectory() as folder:
        offloaded = dispatch_model(copy.deepcopy(target), device_map=PLACEMENT, offload_dir=folder)
        if executor == "stream":
            offloaded = specexec_hf.stream(offloaded)
        assert resident_layers(offloaded) == [True, False, True, False]
        assert resident_layers(target) == [True] * 4
        assert layer_spec(offloaded, "self:exit") == ("self:exit:1", [0])
        assert layer_spec(offloaded, "self:skip") == ("self:skip:1,3", [0, 2])
        streamer = layer_streamer(offloaded)
        for name in ("self:exit", "self:skip"):
            reads = streamer.reads_requested if streamer else 0
            with torch.no_grad():
                resolve_draft(offloaded, name)(ids)
            assert (streamer.reads_requested if streamer else 0) == reads  # the draft read no weight
            out = offloaded.generate(ids, max_new_tokens=16, do_sample=False, assistant_model=name,
                                     speculator="specexec", budget=8)
            assert out.tolist() == expected.tolist()


def test_an_offloaded_target_without_resident_first_layer_needs_explicit_layers():
    target = tiny_model("llama", seed=8, num_layers=4)
    on_disk = dict(PLACEMENT, **{"model.layers.0": "disk"})
    with tempfile.TemporaryDirectory() as folder:
        offloaded = dispatch_model(copy.deepcopy(target), device_map=on_disk, offload_dir=folder)
        with pytest.raises(ValueError, match="name the layers, e.g. 'self:exit:1'"):
            resolve_draft(offloaded, "self:exit")
        assert layer_spec(offloaded, "self:skip") == ("self:skip:0-1,3", [2])


@settings(max_examples=8, deadline=None)
@given(drafted=layer_drafts(), seed=st.integers(0, 2**16), lengths=st.lists(st.integers(1, 10), min_size=2, max_size=3),
       budget=st.integers(1, 16))
def test_batched_draft_forwards_of_a_layer_self_draft_equal_its_forwards_alone(drafted, seed, lengths, budget):
    arch, name = drafted
    draft = resolve_draft(tiny_model(arch, seed=seed, num_layers=LAYER_COUNTS[arch]), name)
    config = specexec_hf.SpecExecConfig(budget=budget, max_depth=6)
    batched = [specexec_hf.SpecExecCandidateGenerator(draft, config) for _ in lengths]
    alone = [specexec_hf.SpecExecCandidateGenerator(draft, config) for _ in lengths]
    rng = torch.Generator().manual_seed(seed)
    histories = [torch.randint(0, 64, (1, n), generator=rng) for n in lengths]
    batch = specexec_hf.grow_trees([(generator, history, None) for generator, history in zip(batched, histories)])
    for generator, history, ours, single in zip(batched, histories, batch.results, alone):
        theirs = single.grow_tree(history)
        assert_same_tree(ours, theirs, model_bound(draft, keys=history.shape[-1] + theirs.tree.num_nodes))
        assert_cache_prefix_equal(generator.cache, recomputed_cache(draft, history), draft)


def test_an_untrained_exit_adapter_changes_nothing_and_a_tuned_one_round_trips(tmp_path):
    from specexec_hf.models import ExitAdapter, layer_self_draft, load_tuned_exit, save_tuned_exit

    target = tiny_model("llama", seed=5, num_layers=4)
    ids = torch.tensor([[1, 2, 3, 4, 5]])
    plain = layer_self_draft(target, [0, 1])
    adapter = ExitAdapter(32, rank=4).double()
    adapted = layer_self_draft(target, [0, 1], exit_adapter=adapter)
    with torch.no_grad():
        assert torch.equal(adapted(ids).logits, plain(ids).logits)
        adapter.up.normal_()
        tuned = adapted(ids).logits
        assert not torch.allclose(tuned, plain(ids).logits)
        assert not any(parameter is adapter.up for parameter in target.parameters())  # the target stays as it was
        save_tuned_exit(tmp_path / "exit.safetensors", [0, 1], adapter)
        assert torch.equal(load_tuned_exit(target, tmp_path / "exit.safetensors")(ids).logits, tuned)
    with pytest.raises(ValueError, match="hidden size is 32"):
        layer_self_draft(target, [0], exit_adapter=ExitAdapter(16, rank=2))
    with pytest.raises(ValueError, match="rank must be in 1..16"):
        ExitAdapter(16, rank=0)
    from safetensors.torch import save_file

    save_file({"weights": torch.zeros(2)}, str(tmp_path / "not_an_exit.safetensors"))
    with pytest.raises(ValueError, match="is not a tuned exit"):
        load_tuned_exit(target, tmp_path / "not_an_exit.safetensors")
