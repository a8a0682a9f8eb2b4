"""Host reads of device data made by specexec_hf's own code: on a GPU each one makes the host wait for the device.

Counted on the CPU by intercepting every torch call made from a line of ``specexec_hf`` whose result the host must
read (``.item()``, ``.tolist()``, ``bool()``/``int()``/``float()`` of a tensor, a tensor used as a Python index,
``.cpu()``, ``nonzero()`` and boolean-mask indexing, whose output size depends on the data). Calls inside the
models (transformers' own mask building, say) are not counted: they are the model's, and the same in plain decoding.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import perturbed_copy, tiny_model
from torch.overrides import TorchFunctionMode

from specexec_hf import SpecExecStats, TokenTree

PACKAGE = str(Path(__file__).resolve().parents[1] / "specexec_hf")
TORCH = str(Path(torch.__file__).resolve().parent)
HOST_READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "cpu", "nonzero", "masked_select"}


def _is_boolean_index(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(item, torch.Tensor) and item.dtype == torch.bool for item in items)


class HostReadCounter(TorchFunctionMode):
    """Counts, by ``file:line``, the torch calls made from ``specexec_hf`` that read device data on the host."""

    def __init__(self):
        super().__init__()
        self.sites: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS or (name in ("__getitem__", "__setitem__") and _is_boolean_index(args[1])):
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_filename.startswith(TORCH):
                frame = frame.f_back
            if frame is not None and frame.f_code.co_filename.startswith(PACKAGE):
                self.sites[f"{Path(frame.f_code.co_filename).relative_to(PACKAGE)}:{frame.f_lineno} {name}"] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.sites.values())


def count_host_reads(budget: int, max_new_tokens: int = 24, **knobs) -> tuple[HostReadCounter, SpecExecStats]:
    """Greedy SpecExec on a tiny Llama pair under :class:`HostReadCounter`."""
    target = tiny_model("llama", seed=0, num_layers=1)
    draft = perturbed_copy(target, 0.05, seed=1)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(0))
    stats = SpecExecStats()
    counter = HostReadCounter()
    with counter:
        target.generate(
            ids, max_new_tokens=max_new_tokens, do_sample=False, assistant_model=draft, speculator="specexec",
            budget=budget, specexec_stats=stats, **knobs,
        )
    return counter, stats


def test_the_counter_sees_host_reads_made_from_the_package():
    tree = TokenTree.from_root(3)
    tree.add_children(torch.tensor([0, 0]), torch.tensor([5, 6]), torch.tensor([-1.0, -2.0]))
    with HostReadCounter() as counter:
        tree.best_path()  # reads logprobs and parents with .tolist()
    assert counter.total == 2, counter.sites


@pytest.mark.parametrize("budget", [16, 128])
def test_host_reads_stay_a_constant_per_draft_forward_and_per_token(budget):
    # Without the acceptance map, whose learning reads its statistics on the host once per expansion.
    counter, stats = count_host_reads(budget, acceptance_calibration=False)
    steps = stats.target_forwards
    # The search reads the device twice per draft forward (which nodes to expand, which children to add) and once
    # when it stops; the walk once per visited node and the stopping criteria once per committed token; the rest is a
    # constant per step (the history, the tree's host copy, its depth, the cache cut, the forecast). Nothing per tree
    # level or node.
    bound = 2 * (stats.draft_forwards + steps) + 2 * stats.new_tokens + 10 * steps
    assert counter.total <= bound, (counter.total, bound, counter.sites.most_common(12))


def test_the_acceptance_map_reads_only_its_own_host_statistics_once_per_step():
    """Ranking a draft forward's candidates reads nothing back: the map's curves are copied to the candidates' device
    and interpolated there. What the map does read is its own counts (host tensors, no device to wait for), when it
    refits its curves after a walk: a constant per step, however many draft forwards the step took."""
    import inspect

    from specexec_hf.core.acceptance_map import NEWTON_STEPS, RANK_GROUPS, AcceptanceMap

    lines, first = inspect.getsourcelines(AcceptanceMap.__call__)
    ranking = range(first, first + len(lines))
    counter, stats = count_host_reads(128)
    off, on = count_host_reads(128, acceptance_calibration=False)[0], counter
    map_sites = {site: n for site, n in on.sites.items() if site.startswith("core/acceptance_map.py:")}
    assert not [site for site in map_sites if int(site.split(":")[1].split()[0]) in ranking], map_sites
    refit = RANK_GROUPS * (2 * NEWTON_STEPS + 4)  # per refit: the Newton steps' checks and the bins read back
    assert sum(map_sites.values()) <= refit * stats.target_forwards, map_sites
    assert stats.draft_forwards > 2 * stats.target_forwards  # many draft forwards per step: the bound can bind
    elsewhere = on.total - sum(map_sites.values())
    bound = 2 * (stats.draft_forwards + stats.target_forwards) + 2 * stats.new_tokens + 12 * stats.target_forwards
    assert elsewhere <= bound, (elsewhere, bound, off.total, on.sites.most_common(12))
