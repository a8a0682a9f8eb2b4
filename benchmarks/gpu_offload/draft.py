"""Section 3, the draft on the GPU: tree growth per budget, a cached 1-token forward and one tree-feed forward
(dynamic cache, static cache and, on CUDA, a CUDA graph replay)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from typing import Any

import torch
from transformers import DynamicCache, LlamaForCausalLM, StaticCache

from specexec_hf import SpecExecCandidateGenerator, SpecExecConfig

from benchmarks.shapes import LlamaShape, random_llama
from benchmarks.timing import Deadline, median, synchronize, warm_median_seconds


def draft_timing(
    shape: LlamaShape, budgets: list[int], context: int, repeats: int, device: torch.device, deadline: Deadline
) -> dict[str, Any]:
    """Tree growth time per budget, and one cached 1-token forward, of a random ``shape`` draft on ``device``.

    The history is cached before timing (in generation the prefix is cached from the previous step), so a
    ``grow_tree`` call times the tree itself. A random draft grows other trees than a trained one (flat and wide:
    fewer forwards per tree), which is why the projection uses its seconds per draft forward, not per tree.
    """
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    draft = random_llama(shape, shape.layers, dtype, seed=1).to(device)
    history = torch.randint(0, shape.vocab, (1, context), generator=torch.Generator().manual_seed(2)).to(device)
    result: dict[str, Any] = {"shape": asdict(shape), "dtype": str(dtype).removeprefix("torch."),
                              "context_tokens": context, "budgets": {}}
    with torch.no_grad():
        cache = DynamicCache()
        draft(input_ids=history[:, :-1], past_key_values=cache, use_cache=True)
        result["one_token_forward_seconds"] = warm_median_seconds(
            lambda: draft(input_ids=history[:, -1:], past_key_values=cache, use_cache=True), repeats, device,
            between=lambda: cache.crop(-1))
        if device.type == "cuda":
            result["one_token_forward_kernel_seconds"] = kernel_seconds(
                lambda: draft(input_ids=history[:, -1:], past_key_values=cache, use_cache=True), device)
            cache.crop(-1)
        result["tree_feed"] = tree_feed_forward(draft, history, SpecExecConfig().expand_per_forward, repeats, device)
    for budget in budgets:
        if not deadline.allows(20):
            result["budgets"][str(budget)] = {"status": "skipped: time budget spent"}
            continue
        generator = SpecExecCandidateGenerator(draft, SpecExecConfig(budget=budget))
        generator.grow_tree(history)  # warm-up; caches the history
        rows = []
        for _ in range(repeats):
            synchronize(device)
            started = time.perf_counter()
            grown = generator.grow_tree(history)
            synchronize(device)
            rows.append((time.perf_counter() - started, grown.draft_forwards))
        seconds = median([s for s, _ in rows])
        forwards = median([f for _, f in rows])
        result["budgets"][str(budget)] = {"tree_seconds": seconds, "draft_forwards": forwards,
                                          "seconds_per_draft_forward": seconds / max(forwards, 1)}
        if device.type == "cuda":
            result["budgets"][str(budget)]["tree_kernel_seconds"] = kernel_seconds(
                partial(generator.grow_tree, history), device)
        print(f"  draft {shape.name}, budget {budget}: {seconds:.3f} s, {forwards} forwards", flush=True)
    return result


def tree_feed_forward(
    draft: LlamaForCausalLM, history: torch.Tensor, rows: int, repeats: int, device: torch.device
) -> dict[str, Any]:
    """One draft forward over a tree feed of ``rows`` nodes after ``history``, as the search runs it (over a
    :class:`DynamicCache`, which grows by concatenation) and over a :class:`StaticCache` of fixed size; on CUDA also
    that static forward captured once as a CUDA graph and replayed, with fixed input buffers: what a forward would
    cost with CUDA-graphed drafting, which is not built (the search feeds the draft through dynamic caches). Its logits
    are checked against the dynamic forward's.
    """
    context = history.shape[1]
    tokens = history[:, -rows:]
    positions = torch.arange(context, context + rows, device=device)[None]
    visible = torch.ones(1, 1, rows, context + rows, dtype=torch.bool, device=device)
    visible[0, 0, :, context:] = torch.ones(rows, rows, dtype=torch.bool, device=device).tril()
    feed = {"input_ids": tokens, "position_ids": positions, "attention_mask": visible, "use_cache": True,
            "logits_to_keep": rows}

    result: dict[str, Any] = {"rows": rows, "context_tokens": context}
    with torch.no_grad():
        dynamic = DynamicCache()
        draft(input_ids=history, past_key_values=dynamic, use_cache=True)

        def dynamic_forward() -> torch.Tensor:
            logits = draft(**feed, past_key_values=dynamic).logits
            dynamic.crop(context)
            return logits

        static = StaticCache(config=draft.config, max_cache_len=context + rows)
        draft(input_ids=history, past_key_values=static, use_cache=True,
              cache_position=torch.arange(context, device=device))
        slots = torch.arange(context, context + rows, device=device)

        def static_forward() -> torch.Tensor:
            for layer in static.layers:  # rewinds where transformers' static layers count their own length
                if isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
                    layer.cumulative_length.fill_(context)
            return draft(**feed, past_key_values=static, cache_position=slots).logits

        result["static_max_abs_difference"] = float((dynamic_forward() - static_forward()).abs().max())
        result["dynamic_cache_seconds"] = warm_median_seconds(dynamic_forward, repeats, device)
        result["static_cache_seconds"] = warm_median_seconds(static_forward, repeats, device)
        if device.type == "cuda":
            try:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm-up off the default stream, as capture requires
                    for _ in range(3):
                        static_forward()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    static_forward()
                result["cuda_graph_seconds"] = warm_median_seconds(graph.replay, repeats, device)
            except Exception as error:  # a forward that cannot be captured says why instead of a figure
                result["cuda_graph_error"] = f"{type(error).__name__}: {error}"[:300]
    return result


def kernel_seconds(work: Callable[[], Any], device: torch.device) -> float | None:
    """The GPU's busy time in one call of ``work``: the summed durations of the kernels and copies it ran (``None``
    where the profiler saw no GPU work: no CUPTI on the machine).

    Against the call's wall time, the rest is the host's (Python, launches): where a small model's forward is host
    bound, a faster GPU does not make it faster.
    """
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as profiled:
        work()
        synchronize(device)
    busy = sum(event.device_time_total for event in profiled.events() if event.device_type == DeviceType.CUDA)
    return busy / 1e6 if busy > 0 else None
