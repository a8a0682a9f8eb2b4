"""Seconds to take a quanto int4 weight packed for the CPU out of that layout: quanto's unpack against the
``quanto_tinygemm_cpu`` patch (issue #32: the CUDA stream executor's install moves every quantized weight to the GPU,
and quanto unpacks a CPU-packed one on the CPU first).

For each ``--shapes`` entry (``OUTxIN``), a bfloat16 linear weight is quantized to int4 by quanto (TinyGemm layout on
the CPU), then turned into quanto's portable form (``weight_qbits_tensor()``, the step of its ``.to("cuda")``):
with quanto's own unpack (where the shape has at most ``--quanto-max-elements`` elements: it costs
``in**2 * out`` multiply-adds), with the patch the first time (its layout learnt) and again. The integers are
compared wherever both ran. Writes ``quanto_cpu_unpack.json`` and ``.md`` under ``--out``.

    .venv/bin/python -m benchmarks.quanto_cpu_unpack --out benchmarks/results/quanto_cpu_unpack
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

from benchmarks.report import write_report


def quantized_weight(rows: int, columns: int) -> torch.Tensor:
    """A random bfloat16 ``[rows, columns]`` linear weight quantized to int4 by quanto, frozen on the CPU."""
    from optimum import quanto

    linear = torch.nn.Linear(columns, rows, bias=False, dtype=torch.bfloat16)
    torch.nn.init.normal_(linear.weight, generator=torch.Generator().manual_seed(rows * columns))
    model = torch.nn.Sequential(linear)
    quanto.quantize(model, weights=quanto.qint4)
    quanto.freeze(model)
    return model[0].weight


def timed_portable(weight: torch.Tensor) -> tuple[float, torch.Tensor]:
    started = time.perf_counter()
    portable = weight.weight_qbits_tensor()
    return time.perf_counter() - started, portable._data.unpack()


def measure(rows: int, columns: int, quanto_max_elements: int) -> dict:
    from specexec_hf.patches import quanto_tinygemm_cpu

    weight = quantized_weight(rows, columns)
    row: dict = {"shape": [rows, columns]}
    quanto_tinygemm_cpu.revert()
    reference = None
    if rows * columns <= quanto_max_elements:
        row["quanto_seconds"], reference = timed_portable(weight)
    quanto_tinygemm_cpu.apply()
    try:
        row["patched_first_seconds"], values = timed_portable(weight)
        row["patched_seconds"], _ = timed_portable(weight)
    finally:
        quanto_tinygemm_cpu.revert()
    if reference is not None:
        row["same_integers"] = bool(torch.equal(values, reference))
    return row


def markdown(report: dict) -> str:
    lines = ["# quanto int4 (CPU layout) to quanto's portable form: seconds", "", report["machine"], "",
             f"Command: `{report['command']}`", "",
             "| weight | quanto's unpack | patched, first (layout learnt) | patched, again | quanto / patched | "
             "same integers |", "|---|---:|---:|---:|---:|---|"]
    for row in report["rows"]:
        quanto = row.get("quanto_seconds")
        ratio = f"{quanto / row['patched_seconds']:.1f}x" if quanto else ""
        lines.append(f"| {row['shape'][0]} x {row['shape'][1]} | {'' if quanto is None else f'{quanto:.2f}'} | "
                     f"{row['patched_first_seconds']:.2f} | {row['patched_seconds']:.3f} | {ratio} | "
                     f"{row.get('same_integers', 'not compared')} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["1024x4096", "4096x4096", "14336x4096", "4096x14336",
                                                        "8192x8192", "28672x8192", "8192x28672"])
    parser.add_argument("--quanto-max-elements", type=int, default=4096 * 14336,
                        help="run quanto's own unpack only on weights this small (it is quadratic in the input width)")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    shapes = [tuple(int(side) for side in shape.split("x")) for shape in args.shapes]
    report = {
        "command": "python -m benchmarks.quanto_cpu_unpack " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}, "
                   f"{torch.get_num_threads()} thread(s)",
        "rows": [],
    }
    args.out.mkdir(parents=True, exist_ok=True)
    for rows, columns in shapes:
        report["rows"].append(measure(rows, columns, args.quanto_max_elements))
        print(report["rows"][-1], flush=True)
        write_report(args.out, "quanto_cpu_unpack", report, markdown(report))


if __name__ == "__main__":
    main()
