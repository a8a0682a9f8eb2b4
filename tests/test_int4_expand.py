"""Quantized (optimum-quanto) linear weights streamed packed and expanded into their compute dtype in the device
ring (``specexec_hf.offload.expand``): the expansion is bit-equal to quanto's ``dequantize()``, and the device
executor, run on the CPU through ``OrderCheckingDevice``, computes what the in-memory model whose quantized weights
are replaced by their dequantized dense weights computes, with the expansion ordered between its slot's upload and
the next upload into that slot."""

from __future__ import annotations

import pytest
import torch
from conftest import importable, perturbed_copy
from hypothesis import given, settings
from hypothesis import strategies as st
from test_cuda_executor import layer_map, placed, prompt
from test_quantized_disk import FORMS
from test_quantized_disk import quantized_model as quantized_layers_model
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaForCausalLM

from specexec_hf.offload import OrderCheckingDevice, OrderingError, device_stream, layer_streamer, stream_on_device
from specexec_hf.offload.expand import PackedWeight, expand_into, expandable, packed_weight

pytestmark = pytest.mark.skipif(not importable("optimum.quanto"), reason="needs optimum-quanto")

DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def quantized_weight(
    rows: int, columns: int, dtype: torch.dtype, group_size: int | None, zero_point: bool, seed: int
) -> torch.Tensor:
    """A quanto int4 weight, in the layout quanto picks for it on the CPU (TinyGemm for bfloat16 in groups of 128,
    its generic packing otherwise); ``group_size`` ``None``: one group per row, as quanto quantizes narrow layers."""
    from optimum.quanto import MaxOptimizer, qint4, quantize_weight

    base = torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed)).to(dtype)
    scale, shift = MaxOptimizer()(base, qtype=qint4, axis=0, group_size=group_size, zeropoint=zero_point)
    return quantize_weight(base, qtype=qint4, axis=0, scale=scale, shift=shift, group_size=group_size)


def int8_weight(rows: int, columns: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    from optimum.quanto import AbsmaxOptimizer, qint8, quantize_weight

    base = torch.randn(rows, columns, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return quantize_weight(base, qtype=qint8, axis=0, scale=AbsmaxOptimizer()(base, qtype=qint8, axis=0))


def expanded(weight: PackedWeight) -> torch.Tensor:
    dense = torch.full(weight.shape, float("nan"), dtype=weight.dtype)  # nothing left unwritten passes
    expand_into(weight, dense, torch.full((weight.scratch_bytes + 3,), 0xFF, dtype=torch.uint8))
    return dense


@st.composite
def int4_weights(draw) -> torch.Tensor:
    dtype = draw(st.sampled_from(DTYPES))
    group_size = draw(st.sampled_from([32, 64, 96, 128, None]))
    columns = (group_size or 8) * draw(st.integers(1, 3))
    tinygemm = dtype == torch.bfloat16 and group_size == 128  # torch's CPU int4 packer: rows in multiples of 16
    rows = 16 * draw(st.integers(1, 3)) if tinygemm else draw(st.integers(1, 40))
    zero_point = not tinygemm and draw(st.booleans())  # quanto's TinyGemm takes float shifts only
    return quantized_weight(rows, columns, dtype, group_size, zero_point, draw(st.integers(0, 2**16)))


@settings(max_examples=60)
@given(weight=int4_weights())
def test_expansion_is_bit_equal_to_quantos_dequantize(weight):
    packed = packed_weight(weight)
    assert packed.packed.dtype == torch.uint8 and packed.packed.numel() == -(-packed.groups // 2) * packed.group_size
    assert torch.equal(expanded(packed), weight.dequantize())


@settings(max_examples=20)
@given(
    rows=st.integers(2, 40), columns=st.integers(1, 300), dtype=st.sampled_from(DTYPES), seed=st.integers(0, 2**16)
)  # a single row is quantized per tensor (axis None), which stays unexpanded
def test_int8_expansion_is_bit_equal_to_quantos_dequantize(rows, columns, dtype, seed):
    weight = int8_weight(rows, columns, dtype, seed)
    assert torch.equal(expanded(packed_weight(weight)), weight.dequantize())


class OutputDtypes(TorchDispatchMode):
    """Records ``(op, output dtype, its inputs' promoted dtype)`` for every kernel called with ``out=``."""

    def __init__(self):
        super().__init__()
        self.outputs = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "out" in kwargs:
            self.outputs.append((func, kwargs["out"].dtype, torch.result_type(args[0], args[1])))
        return func(*args, **kwargs)


@pytest.mark.parametrize("zero_point", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_kernel_writes_the_dtype_its_inputs_promote_to(dtype, zero_point):
    """As torch's CUDA kernels need: they dispatch on the output's dtype (bitwise ones take integer outputs only);
    only the CPU casts into another output dtype, through a temporary. So nothing this CPU test sees can fail there."""
    for weight in (quantized_weight(6, 64, dtype, 32, zero_point, 0), int8_weight(6, 64, dtype, 0)):
        weight = packed_weight(weight)
        with OutputDtypes() as recorded:
            expanded(weight)
        assert recorded.outputs and all(output == promoted for _, output, promoted in recorded.outputs)


def test_a_generic_weight_is_taken_as_views_of_its_own_inner_tensors():
    weight = quantized_weight(20, 256, torch.float32, 128, False, 0)
    packed = packed_weight(weight)
    assert packed.packed.data_ptr() == weight._data._data.data_ptr()
    assert packed.scale.data_ptr() == weight._scale.data_ptr() and packed.shift.data_ptr() == weight._shift.data_ptr()


def test_every_value_and_both_nibbles_reach_the_dense_weight():
    """Each position takes its own nibble: a weight whose values are their own positions modulo 16."""
    from optimum.quanto import WeightQBitsTensor, qint4

    groups, group_size = 5, 32
    values = (torch.arange(groups * group_size) % 16).to(torch.uint8).view(groups, group_size)
    scale = torch.ones(groups, 1)
    shift = torch.zeros(groups, 1)
    weight = WeightQBitsTensor(qint4, 0, group_size, (groups, group_size), (group_size, 1), values, scale, shift)
    assert torch.equal(expanded(packed_weight(weight)), values.float())


def test_a_weight_that_does_not_expand_is_refused_naming_the_setting():
    assert not expandable(torch.zeros(4, 4)) and not expandable(torch.nn.Parameter(torch.zeros(4, 4)))
    with pytest.raises(ValueError, match="expand_quantized=False"):
        packed_weight(torch.zeros(4, 4))


def test_a_dense_buffer_of_another_shape_or_dtype_or_a_short_scratch_is_refused():
    packed = packed_weight(quantized_weight(4, 64, torch.float32, 32, False, 0))
    scratch = torch.empty(packed.scratch_bytes, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"expands into a contiguous \[4, 64\] torch.float32"):
        expand_into(packed, torch.empty(4, 64, dtype=torch.bfloat16), scratch)
    with pytest.raises(ValueError, match="contiguous"):
        expand_into(packed, torch.empty(64, 4).t(), scratch)
    with pytest.raises(ValueError, match=f"needs {packed.scratch_bytes} x uint8"):
        expand_into(packed, torch.empty(4, 64), scratch[1:])


# The device executor, on the CPU through OrderCheckingDevice.


def quantized_model(form: str, seed: int, num_layers: int = 3, head: bool = False) -> LlamaForCausalLM:
    """:func:`test_quantized_disk.quantized_model`'s Llama (hidden 128: quanto groups the 256-wide down projections
    by 128, in TinyGemm's layout for bfloat16, the others by row), with ``head`` its LM head quantized too."""
    from optimum import quanto

    model = quantized_layers_model(form, seed, num_layers)
    if head:
        quanto.quantize(model, weights=getattr(quanto, FORMS[form][0]), include=["lm_head"])
        quanto.freeze(model)
    return model


def dequantized(model: LlamaForCausalLM, device_map: dict | None = None) -> LlamaForCausalLM:
    """``model`` with the quantized linear layers of its streamed units (all, without ``device_map``) replaced by
    plain ``nn.Linear`` layers over quanto's ``dequantize()`` of their weights: what the device executor computes
    (resident units keep quanto's weights)."""
    for name, module in list(model.named_modules()):
        streamed = device_map is None or any(
            where in ("cpu", "disk") and (name == unit or name.startswith(unit + "."))
            for unit, where in device_map.items()
        )
        if streamed and isinstance(module, nn.Linear) and type(module.weight) not in (torch.Tensor, nn.Parameter):
            plain = nn.Linear(module.in_features, module.out_features, bias=module.bias is not None)
            plain.weight = nn.Parameter(module.weight.dequantize(), requires_grad=False)
            plain.bias = module.bias
            parent, _, attribute = name.rpartition(".")
            setattr(model.get_submodule(parent), attribute, plain)
    return model


def slot_holding(streamer, tensor: torch.Tensor, buffer: str = "buffer"):
    """The slot whose ring buffer (or, with ``buffer="dense"``, dense buffer) holds ``tensor``."""
    return next(
        slot for slot in streamer._slots
        if getattr(slot, buffer) is not None
        and 0 <= tensor.data_ptr() - getattr(slot, buffer).data_ptr() < getattr(slot, buffer).numel()
    )


def checked_expansions(monkeypatch, streamed, device: OrderCheckingDevice) -> list[int]:
    """Makes every expansion of ``streamed``'s streamer check, as it runs, that the compute may read the slot it
    reads: the stand-in holds the slot open (its upload was waited for, and no later upload into it was issued).
    Returns the positions expanded, in order."""
    streamer = layer_streamer(streamed)
    expand = device_stream.expand_into
    expanded = []

    def checked(weight, dense, scratch):
        slot = slot_holding(streamer, weight.packed)
        if slot.buffer.data_ptr() not in device._open:
            raise OrderingError(
                "an expansion reads a slot before the compute waited for its upload, or after the next upload into "
                "it was issued"
            )
        expanded.append(slot.position)
        expand(weight, dense, scratch)

    monkeypatch.setattr(device_stream, "expand_into", checked)
    return expanded


@settings(max_examples=20)
@given(
    form=st.sampled_from(sorted(FORMS)),
    seed=st.integers(0, 2**16),
    places=st.sampled_from([["cpu"], [0, "cpu"], ["cpu", "cpu", 0]]),
    prefetch=st.integers(1, 3),
    head=st.booleans(),
    tree_tokens=st.integers(2, 48),
)
def test_streamed_quantized_layers_compute_the_dequantized_model_bit_for_bit(
    form, seed, places, prefetch, head, tree_tokens
):
    """One token and a tree-sized feed, from an empty cache and after a prompt, in several forwards (the ring wraps
    around): the logits of the dense model over quanto's dequantized weights, every expansion in order."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        reference = quantized_model(form, seed, head=head)
        device_map = placed(reference, places)
        reference = dequantized(reference, device_map)
        device = OrderCheckingDevice()
        streamed = stream_on_device(quantized_model(form, seed, head=head), device_map, device, prefetch=prefetch)
        expanded = checked_expansions(monkeypatch, streamed, device)
        with torch.no_grad():
            for ids in (prompt(seed, 1), prompt(seed, tree_tokens), prompt(seed, 1), prompt(seed + 1, tree_tokens)):
                assert torch.equal(streamed(ids).logits, reference(ids).logits)
            context, tree = prompt(seed, 5), prompt(seed + 2, tree_tokens)
            expected = reference(tree, past_key_values=reference(context, use_cache=True).past_key_values).logits
            got = streamed(tree, past_key_values=streamed(context, use_cache=True).past_key_values).logits
            assert torch.equal(got, expected)
        assert expanded  # the expansion ran, checked


@pytest.mark.parametrize("form", ["int4 bf16", "int4 f32", "int8 f32"])
def test_greedy_generate_plain_and_specexec_equal_the_dequantized_models(form):
    """The same tokens as the in-memory dense model, plain and with SpecExec (whose tree forwards, in bfloat16, may
    round apart from one-token forwards: it is compared with the same SpecExec over the in-memory model)."""
    reference = dequantized(quantized_model(form, 3, head=True))
    device_map = layer_map(reference, "cpu")
    streamed = stream_on_device(quantized_model(form, 3, head=True), device_map, OrderCheckingDevice())
    ids = prompt(4, 6)
    expected = reference.generate(ids, max_new_tokens=16, do_sample=False)
    assert streamed.generate(ids, max_new_tokens=16, do_sample=False).tolist() == expected.tolist()
    draft = perturbed_copy(reference, 0.05, seed=5)
    specexec = {"do_sample": False, "assistant_model": draft, "speculator": "specexec", "budget": 12}
    expected = reference.generate(ids, max_new_tokens=16, **specexec)
    assert streamed.generate(ids, max_new_tokens=16, **specexec).tolist() == expected.tolist()


def test_packed_bytes_stream_and_the_dense_weights_are_fixed_views_expanded_once_per_fill(monkeypatch):
    """The ring receives the packed bytes; each slot's dense buffer holds its layer's dense weights, at addresses
    that never move; a layer that cycles expands once per forward, one alone in its slot (the head, here) once."""
    reference = dequantized(quantized_model("int4 bf16", 1, head=True))
    device = OrderCheckingDevice()
    streamed = stream_on_device(quantized_model("int4 bf16", 1, head=True), layer_map(reference, "cpu"), device)
    streamer = layer_streamer(streamed)
    expanded = checked_expansions(monkeypatch, streamed, device)
    dense_layer_bytes = sum(p.numel() * p.element_size() for p in reference.model.layers[0].parameters())
    assert streamer._unit_bytes[0] < 0.4 * dense_layer_bytes  # packed int4 and its scales, not a dense copy
    assert type(streamed.lm_head) is nn.Linear and slot_holding(streamer, streamed.lm_head.weight, "dense")
    q_proj = [streamed.model.layers[index].self_attn.q_proj.weight for index in (0, 2)]
    assert slot_holding(streamer, q_proj[0], "dense") is slot_holding(streamer, q_proj[1], "dense")
    dense_bytes = sum(slot.dense.numel() for slot in streamer._slots if slot.dense is not None)
    assert streamer.expansion_bytes == dense_bytes + streamer._scratch.numel() and streamer._scratch.numel() > 0
    addresses = [p.data_ptr() for p in streamed.parameters()]
    ids = prompt(0, 5)
    forwards = 3
    with torch.no_grad():
        for _ in range(forwards):
            assert torch.equal(streamed(ids).logits, reference(ids).logits)
    assert [p.data_ptr() for p in streamed.parameters()] == addresses
    head = streamer.unit_names.index("lm_head")
    assert streamer._stays_loaded[head] and not streamer._stays_loaded[0]
    linears = [sum(isinstance(m, nn.Linear) for m in streamed.get_submodule(n).modules()) for n in streamer.unit_names]
    assert [expanded.count(position) for position in range(len(linears))] == [
        count * (1 if stays else forwards) for count, stays in zip(linears, streamer._stays_loaded)
    ]


def test_an_expansion_before_the_wait_for_its_upload_is_caught(monkeypatch):
    """The checks can fail: a streamer that expands a slot before the compute waited for its upload."""
    model = quantized_model("int4 f32", 0)
    device = OrderCheckingDevice()
    streamed = stream_on_device(model, layer_map(model, "cpu"), device)
    streamer = layer_streamer(streamed)
    checked_expansions(monkeypatch, streamed, device)
    wait = streamer._await
    monkeypatch.setattr(streamer, "_await", lambda slot: (streamer._expand(slot), wait(slot)))
    with torch.no_grad(), pytest.raises(OrderingError, match="before the compute waited"):
        streamed(prompt(0, 3))


def test_an_expansion_queued_after_the_next_upload_into_its_slot_is_caught(monkeypatch):
    """The checks can fail the other way too: a streamer that expands a layer late, once the next upload into its
    slot was issued (it would read bytes that upload overwrites)."""
    model = quantized_model("int4 f32", 0, num_layers=4)
    device = OrderCheckingDevice()
    streamed = stream_on_device(model, layer_map(model, "cpu"), device)
    streamer = layer_streamer(streamed)
    checked_expansions(monkeypatch, streamed, device)
    expand, late = streamer._expand, []

    def expand_the_previous_layer(slot):
        if late:
            expand(late.pop())
        late.append(slot)

    monkeypatch.setattr(streamer, "_expand", expand_the_previous_layer)
    with torch.no_grad(), pytest.raises(OrderingError, match="after the next upload"):
        streamed(prompt(0, 3))


def test_the_packed_path_stays_reachable_for_comparison():
    """``expand_quantized=False``: quanto's weights in the layout it picks for the device, its own products."""
    reference = quantized_model("int4 bf16", 2)
    streamed = stream_on_device(quantized_model("int4 bf16", 2), layer_map(reference, "cpu"), OrderCheckingDevice(),
                                expand_quantized=False)
    weight = streamed.model.layers[0].mlp.down_proj.weight
    assert type(weight) is type(reference.model.layers[0].mlp.down_proj.weight)
    assert layer_streamer(streamed).expansion_bytes == 0
    ids = prompt(1, 6)
    with torch.no_grad():
        assert torch.equal(streamed(ids).logits, reference(ids).logits)


def test_resident_and_activation_quantized_layers_keep_quantos_form():
    """Only streamed, weight-only quantized linear layers expand: a resident layer keeps quanto's weight, and so
    does a layer whose activations quanto quantizes too (its forward quantizes them)."""
    from optimum import quanto

    model = quantized_model("int8 f32", 0)
    quanto.quantize(model.model.layers[2], weights=quanto.qint8, activations=quanto.qint8)
    quanto.freeze(model)
    device_map = layer_map(model, "cpu")
    device_map["model.layers.1"] = 0
    streamed = stream_on_device(model, device_map, OrderCheckingDevice())
    assert type(streamed.model.layers[0].mlp.up_proj) is nn.Linear
    assert type(streamed.model.layers[1].mlp.up_proj) is not nn.Linear  # resident
    assert type(streamed.model.layers[2].mlp.up_proj) is not nn.Linear  # activations quantized


def test_the_next_layers_upload_is_queued_before_the_layers_expansion(monkeypatch):
    """So that it overlaps the expansion: its slot-free event is recorded before the expansion is queued."""
    model = quantized_model("int4 f32", 0)
    device = OrderCheckingDevice()
    streamed = stream_on_device(model, layer_map(model, "cpu"), device)
    streamer = layer_streamer(streamed)
    log = []
    copy_up, expand = device.copy, device_stream.expand_into
    slot_index = {slot.buffer.data_ptr(): index for index, slot in enumerate(streamer._slots)}

    def logged_copy(target, source, after):
        log.append(("upload", slot_index[target.data_ptr()]))
        return copy_up(target, source, after)

    def logged_expand(weight, dense, scratch):
        slot = [id(s) for s in streamer._slots].index(id(slot_holding(streamer, weight.packed)))
        if log[-1:] != [("expand", slot)]:
            log.append(("expand", slot))
        expand(weight, dense, scratch)

    monkeypatch.setattr(device, "copy", logged_copy)
    monkeypatch.setattr(device_stream, "expand_into", logged_expand)
    with torch.no_grad():
        streamed(prompt(0, 3))
    assert log[:5] == [("upload", 0), ("upload", 1), ("expand", 0), ("upload", 0), ("expand", 1)]


@pytest.mark.cuda
@pytest.mark.parametrize("form", ["int4 bf16", "int4 f32", "int8 f32"])
def test_cuda_quantized_layers_expand_on_the_gpu_bit_equal_to_the_dequantized_model(form):
    """On the GPU the expansion's kernels (a uint8 -> float store, the scale's product, the shift) round as quanto's
    dequantize() does on the CPU, and the dense products are the in-memory dense model's: same logits, same text."""
    from specexec_hf.offload import CudaDevice

    reference = dequantized(quantized_model(form, 6, head=True))
    draft = perturbed_copy(reference, 0.05, seed=5).to("cuda")
    reference.to("cuda")
    device_map = layer_map(reference, "cpu")
    streamed = stream_on_device(quantized_model(form, 6, head=True), device_map, CudaDevice(0), prefetch=1)
    assert layer_streamer(streamed).expansion_bytes > 0
    with torch.no_grad():
        for ids in (prompt(7, 1).cuda(), prompt(7, 40).cuda(), prompt(8, 1).cuda()):
            assert torch.equal(streamed(ids).logits, reference(ids).logits)
    ids = prompt(9, 6).cuda()
    specexec = {"do_sample": False, "assistant_model": draft, "speculator": "specexec"}
    expected = reference.generate(ids, max_new_tokens=16, **specexec)
    assert streamed.generate(ids, max_new_tokens=16, **specexec).tolist() == expected.tolist()
