"""``core.products.head_product``: ``F.linear`` up to rounding, and ``F.linear`` itself where it does not apply; the
walk's head rows through it (``hf.forward._head_rows``): hooks kept, other per-instance forwards left alone, threads."""

from __future__ import annotations

import threading

import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st
from tolerances import assert_close_across_kernels, rounding_bound

from specexec_hf.core.products import head_product


@given(
    seed=st.integers(0, 2**16),
    rows=st.integers(0, 40),
    widths=st.tuples(st.integers(1, 96), st.integers(1, 200)),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.bfloat16]),
)
def test_head_product_is_f_linear_up_to_rounding(seed, rows, widths, dtype):
    generator = torch.Generator().manual_seed(seed)
    inputs, outputs = widths
    hidden = torch.randn(rows, inputs, generator=generator).to(dtype)
    weight = torch.randn(outputs, inputs, generator=generator).to(dtype)
    got, expected = head_product(hidden, weight), F.linear(hidden, weight)
    assert got.shape == expected.shape and got.dtype == dtype and got.is_contiguous()
    if dtype != torch.float32 or rows < 2:
        assert torch.equal(got, expected)  # F.linear itself
    else:
        assert_close_across_kernels(got, expected, rounding_bound(dtype, reduction=inputs))


def test_walk_head_rows_leave_a_per_instance_forward_alone():
    from specexec_hf.hf.forward import _head_rows

    head = torch.nn.Linear(8, 32, bias=False)
    calls = []

    def wrapped(rows):  # as a library wrapping a module's forward per instance would
        calls.append(rows.shape[0])
        return F.linear(rows, head.weight)

    head.forward = wrapped
    rows = torch.randn(4, 8)
    assert torch.equal(_head_rows(head, rows), F.linear(rows, head.weight))
    assert calls == [4] and head.forward is wrapped


def test_walk_head_rows_from_two_threads_at_once():
    """A walk whose head call is under way in one thread (its hook waiting, as the stream executor's waits on a read)
    while another thread's walk calls the same head: both get their rows and the head's own forward is back."""
    from specexec_hf.hf.forward import _head_rows

    head = torch.nn.Linear(16, 64, bias=False)
    first_in_hook, second_done = threading.Event(), threading.Event()

    def hook(module, args):
        if threading.current_thread().name == "first" and not first_in_hook.is_set():
            first_in_hook.set()
            second_done.wait(timeout=0.5)  # the second walk cannot finish while the first holds the head

    head.register_forward_pre_hook(hook)
    rows = {"first": torch.randn(3, 16), "second": torch.randn(5, 16)}
    results, errors = {}, []

    def walk() -> None:
        name = threading.current_thread().name
        try:
            if name == "second":
                first_in_hook.wait(timeout=5)
            results[name] = _head_rows(head, rows[name])
        except BaseException as error:
            errors.append(error)
        finally:
            if name == "second":
                second_done.set()

    threads = [threading.Thread(target=walk, name=name) for name in rows]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=10)
    assert not errors
    assert all(torch.equal(results[name], head_product(rows[name], head.weight)) for name in rows)
    assert "forward" not in vars(head)
