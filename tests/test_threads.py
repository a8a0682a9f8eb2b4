"""Threads sharing one streamed target: its ring has one owner at a time, so calls are exact and never hang.

A streamed target computes out of a ring of weight buffers; two calls running at once would overwrite each other's
weights (or, on a fresh target, await a read nothing performs). Its streamer serialises whole ``generate()`` calls
and each top-level forward; these tests run plain, SpecExec and bare-forward calls from several threads at once and
compare every result with the in-memory target's.
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import ExitStack

import pytest
import torch
from conftest import perturbed_copy, tiny_model
from hypothesis import Phase, given, settings
from hypothesis import strategies as st
from transformers import AutoModelForCausalLM
from transformers.generation.streamers import BaseStreamer

from specexec_hf.hf.ownership import CallLock
from specexec_hf.offload import OrderCheckingDevice, layer_streamer, load_offloaded, stream_on_device, weight_units

JOIN_SECONDS = 20
"""Far beyond what the tiny model's calls take, all of them one after another: a thread alive then is hung."""
BLOCKED_SECONDS = 0.5
"""How long a forward from another thread is watched to stay blocked behind a running call (it takes milliseconds)."""
STRAGGLER_SECONDS = 0.5
"""How late the read a failed forward left in flight lands."""
REPORTED_AS_FOUND = [Phase.explicit, Phase.reuse, Phase.generate]
"""Hypothesis's phases less shrinking: a hang costs JOIN_SECONDS an example (and leaves a shared target owned), so
the first failing example is reported as it was found."""
NUM_LAYERS = 4  # with the head, more units than a prefetch-1 ring has buffers: the ring cycles
MAX_NEW_TOKENS = 10

CALLS = ("plain", "specexec", "specexec draft_ahead", "forward")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama saved as a checkpoint, the checkpoint loaded in memory (what a stream of it computes, bit for
    bit) and a draft for it."""
    folder = tmp_path_factory.mktemp("threads")
    target = tiny_model("llama", seed=5, num_layers=NUM_LAYERS)
    target.save_pretrained(folder)
    in_memory = AutoModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
    return folder, in_memory, perturbed_copy(target, 0.05, seed=6)


def streamed(folder, executor: str = "stream"):
    """A fresh, never-run target streamed from ``folder`` by the CPU executor or, on the CPU stand-in device, by
    the accelerator's executor."""
    if executor == "stream":
        return load_offloaded(folder, max_memory={"cpu": 0}, executor="stream")
    model = tiny_model("llama", num_layers=NUM_LAYERS)
    device_map = {name: "disk" for name in weight_units(model)}
    return stream_on_device(folder, device_map, OrderCheckingDevice())


@pytest.fixture(scope="module")
def warm_target(checkpoint):
    """One streamed target shared by the examples of a test: warm after the first."""
    model = streamed(checkpoint[0])
    yield model
    layer_streamer(model).close()


def prompt(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    length = int(torch.randint(1, 9, (), generator=generator))
    return torch.randint(0, 64, (1, length), generator=generator)


def call(model, draft, kind: str, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    """One call of ``kind`` on ``model``: the generated sequence, or a bare forward's logits."""
    if kind == "forward":
        with torch.no_grad():
            return model(ids, **kwargs).logits
    speculation = {} if kind == "plain" else dict(
        assistant_model=draft, speculator="specexec", budget=6, draft_ahead=kind.endswith("draft_ahead")
    )
    return model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, **speculation, **kwargs)


def expected(checkpoint, kind: str, ids: torch.Tensor) -> torch.Tensor:
    """What ``kind`` gives on the in-memory target, alone (plain greedy for every generating call)."""
    _, target, draft = checkpoint
    return call(target, draft, "forward" if kind == "forward" else "plain", ids)


def run_at_once(calls: list[Callable[[], object]]) -> list[object]:
    """Runs each call on a thread of its own, all released together; their results, or what they raised.

    Fails if a thread is still running after :data:`JOIN_SECONDS` (its call hangs; the thread is left behind).
    """
    start = threading.Barrier(len(calls))
    results: list[object] = [None] * len(calls)

    def run(index: int) -> None:
        start.wait()
        try:
            results[index] = calls[index]()
        except BaseException as error:  # noqa: BLE001 - handed to the test, which checks it
            results[index] = error

    threads = [threading.Thread(target=run, args=(index,), daemon=True) for index in range(len(calls))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + JOIN_SECONDS
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    hung = sum(thread.is_alive() for thread in threads)
    assert not hung, f"{hung} of {len(threads)} threads still running after {JOIN_SECONDS} s: their calls hang"
    return results


def assert_exact(results: list[object], references: list[torch.Tensor]) -> None:
    for index, (got, reference) in enumerate(zip(results, references)):
        if isinstance(got, BaseException):
            raise AssertionError(f"call {index} raised") from got
        assert torch.equal(got, reference), f"call {index} differs from the in-memory target's result"


def calls_of(model, draft, kinds: list[str], prompts: list[torch.Tensor]) -> list[Callable[[], torch.Tensor]]:
    return [lambda kind=kind, ids=ids: call(model, draft, kind, ids) for kind, ids in zip(kinds, prompts)]


@settings(max_examples=15, phases=REPORTED_AS_FOUND)
@given(kinds=st.lists(st.sampled_from(CALLS), min_size=2, max_size=8), seed=st.integers(0, 2**16))
def test_concurrent_calls_on_a_warm_streamed_target_equal_the_in_memory_target(checkpoint, warm_target, kinds, seed):
    prompts = [prompt(seed + index) for index in range(len(kinds))]
    references = [expected(checkpoint, kind, ids) for kind, ids in zip(kinds, prompts)]
    assert_exact(run_at_once(calls_of(warm_target, checkpoint[2], kinds, prompts)), references)


@pytest.mark.parametrize("executor", ["stream", "device stand-in"])
def test_concurrent_calls_on_a_fresh_streamed_target_neither_hang_nor_differ(checkpoint, executor):
    kinds = [CALLS[index % len(CALLS)] for index in range(8)]
    prompts = [prompt(index) for index in range(len(kinds))]
    references = [expected(checkpoint, kind, ids) for kind, ids in zip(kinds, prompts)]
    model = streamed(checkpoint[0], executor)
    try:
        results = run_at_once(calls_of(model, checkpoint[2], kinds, prompts))
    finally:
        layer_streamer(model).close()
    assert_exact(results, references)


@settings(max_examples=10, phases=REPORTED_AS_FOUND)
@given(calls=st.integers(2, 6), depth=st.integers(1, 3), failing=st.sets(st.integers(0, 5)))
def test_a_call_lock_is_held_by_one_call_at_a_time_and_passes_the_threads_that_call_starts(calls, depth, failing):
    """Each call takes the lock ``depth`` times over and starts a helper thread in a copy of its context, which takes
    it too; the calls in ``failing`` raise while holding it."""
    lock = CallLock()
    inside: list[int] = []
    most_inside, helped = [0], []

    def take(index: int) -> None:
        with ExitStack() as holds:
            for _ in range(depth):
                holds.enter_context(lock.held())
            inside.append(index)
            most_inside[0] = max(most_inside[0], len(inside))
            helper = threading.Thread(target=contextvars.copy_context().run, args=(help_call, index), daemon=True)
            helper.start()
            helper.join(JOIN_SECONDS)
            assert not helper.is_alive(), "a thread the holding call started waits for the lock"
            time.sleep(0.001)  # room for another call to enter, were the lock not held
            inside.remove(index)
            if index in failing:
                raise RuntimeError("the call failed while holding the lock")

    def help_call(index: int) -> None:
        with lock.held():
            helped.append(index)

    results = run_at_once([lambda index=index: take(index) for index in range(calls)])
    for index, result in enumerate(results):
        if index in failing:
            assert isinstance(result, RuntimeError) and "failed while holding" in str(result), result
        else:
            assert result is None, result
    assert most_inside[0] == 1, "two calls held the lock at once"
    assert sorted(helped) == list(range(calls))


def fail_mid_forward(module, args, output) -> None:
    raise RuntimeError("a layer failed mid-forward")


class _FailingStreamer(BaseStreamer):
    """Raises on the ``fail_at``-th batch of tokens it receives: an error inside a running call."""

    def __init__(self, fail_at: int):
        self.remaining = fail_at

    def put(self, value: torch.Tensor) -> None:
        self.remaining -= 1
        if self.remaining <= 0:
            raise RuntimeError("the caller's streamer failed")

    def end(self) -> None:
        pass


def test_a_call_that_raises_releases_the_target_for_the_others(checkpoint):
    """One thread's calls fail (in its streamer after a few steps, then in the middle of a forward, with reads
    queued ahead into the ring); the others' calls all complete, exact."""
    folder, _, draft = checkpoint
    model = streamed(folder)
    failing_layer = model.get_submodule(layer_streamer(model).unit_names[1])

    def fail_in_the_failing_thread(module, args, output) -> None:
        if threading.current_thread().name == "failing":
            fail_mid_forward(module, args, output)

    failing_layer.register_forward_hook(fail_in_the_failing_thread)

    def fail_twice() -> None:
        with pytest.raises(RuntimeError, match="streamer failed"):
            call(model, draft, "specexec", prompt(0), streamer=_FailingStreamer(fail_at=2))
        threading.current_thread().name = "failing"
        with pytest.raises(RuntimeError, match="mid-forward"):
            call(model, draft, "plain", prompt(0))

    kinds = ["plain", "specexec", "forward", "specexec draft_ahead"]
    prompts = [prompt(index + 1) for index in range(len(kinds))]
    references = [expected(checkpoint, kind, ids) for kind, ids in zip(kinds, prompts)]
    try:
        results = run_at_once([fail_twice, *calls_of(model, draft, kinds, prompts)])
        assert results[0] is None, f"the failing thread's calls did not fail as planned: {results[0]!r}"
        assert_exact(results[1:], references)
    finally:
        layer_streamer(model).close()


class _HoldingStreamer(BaseStreamer):
    """Keeps a running call waiting at its first tokens until ``release`` is set; sets ``entered`` when there."""

    def __init__(self):
        self.entered, self.release = threading.Event(), threading.Event()

    def put(self, value: torch.Tensor) -> None:
        self.entered.set()
        assert self.release.wait(JOIN_SECONDS), "never released"

    def end(self) -> None:
        pass


@pytest.mark.parametrize("kind", ["plain", "specexec"])
def test_a_bare_forward_from_another_thread_waits_for_the_running_call(checkpoint, warm_target, kind):
    _, _, draft = checkpoint
    holding = _HoldingStreamer()
    ids = prompt(11)
    running = threading.Thread(
        target=call, args=(warm_target, draft, kind, ids), kwargs={"streamer": holding}, daemon=True
    )
    running.start()
    assert holding.entered.wait(JOIN_SECONDS), "the call never produced tokens"
    logits: list[torch.Tensor] = []
    forward = threading.Thread(target=lambda: logits.append(call(warm_target, draft, "forward", ids)), daemon=True)
    forward.start()
    forward.join(BLOCKED_SECONDS)
    interleaved = not forward.is_alive()
    holding.release.set()
    running.join(JOIN_SECONDS)
    forward.join(JOIN_SECONDS)
    assert not interleaved, "a bare forward ran in the middle of another thread's generate() call"
    assert not forward.is_alive() and not running.is_alive(), "a call hangs"
    assert torch.equal(logits[0], expected(checkpoint, "forward", ids))


def test_a_read_refused_when_queued_is_read_again_by_the_next_forward(checkpoint):
    """A fill that fails to start (the reader refuses it) leaves no buffer awaiting a read nothing performs."""
    model = streamed(checkpoint[0])
    streamer = layer_streamer(model)
    reader = streamer._direct_reader
    submit = reader.submit
    refused = []

    def refuse_the_first(plan) -> Future:
        if not refused:
            refused.append(plan)
            raise OSError("the reader refused a request")
        return submit(plan)

    reader.submit = refuse_the_first
    ids = prompt(3)
    try:
        (refusal,) = run_at_once(calls_of(model, None, ["forward"], [ids]))
        assert isinstance(refusal, OSError), f"the refused read did not raise in the forward: {refusal!r}"
        assert_exact(run_at_once(calls_of(model, None, ["forward"], [ids])), [expected(checkpoint, "forward", ids)])
    finally:
        streamer.close()


def test_a_fill_never_starts_into_a_buffer_an_abandoned_fill_still_lands_in(checkpoint):
    """A forward that raises leaves its read-ahead in flight; the next forward, reusing that buffer for another
    unit, waits for the straggler to land before reading into the buffer (else its bytes could land last)."""
    model = streamed(checkpoint[0])
    streamer = layer_streamer(model)
    reader = streamer._direct_reader
    submit = reader.submit
    plans = [plan for _, plan in streamer._units]
    # Unit 1's pre-hook queues unit 2's read, into the buffer unit 0 computes in: that read lands late.
    straggler = plans[2]
    buffer_of = {id(plan): streamer._slot_of[position] for position, plan in enumerate(plans)}
    in_flight: dict[int, list[Future]] = {}
    overlapping, late = [], []

    def late_straggler(plan) -> Future:
        overlapping.extend(fill for fill in in_flight.get(buffer_of[id(plan)], []) if not fill.done())
        if plan is not straggler or late:
            landed = submit(plan)
        else:
            late.append(plan)
            landed = Future()

            def read_late() -> None:
                time.sleep(STRAGGLER_SECONDS)
                submit(plan).add_done_callback(lambda fill: landed.set_result(fill.result()))

            threading.Thread(target=read_late, daemon=True).start()
        in_flight.setdefault(buffer_of[id(plan)], []).append(landed)
        return landed

    ids = prompt(4)
    forward = calls_of(model, None, ["forward"], [ids])
    try:
        run_at_once(forward)  # fills the ring
        failing = model.get_submodule(streamer.unit_names[1]).register_forward_hook(fail_mid_forward)
        reader.submit = late_straggler
        (failure,) = run_at_once(forward)
        assert isinstance(failure, RuntimeError), f"the forward did not fail as planned: {failure!r}"
        failing.remove()
        logits = run_at_once(forward)
        assert not overlapping, "a fill started into a ring buffer while another fill was still landing there"
        assert_exact(logits, [expected(checkpoint, "forward", ids)])
    finally:
        streamer.close()
