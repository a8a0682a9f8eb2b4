"""The benchmarks: one module per benchmark, run from the repository root as ``python -m benchmarks.<name>``
(``python -m benchmarks.gpu_offload`` for the GPU benchmark's sections), each writing its report to
``benchmarks/results/<name>/`` (indexed in ``benchmarks/results/INDEX.md``).

They stand on the library and on their shared modules, which import no benchmark: :mod:`benchmarks.timing` (timers),
:mod:`benchmarks.report` (the JSON and Markdown writer, goals as records), :mod:`benchmarks.shapes` (random-weight
Llama shapes), :mod:`benchmarks.figure_checks`, :mod:`benchmarks.memory_cap` and :mod:`benchmarks.synthetic_models`.
Nothing in the library imports them (``tests/test_layout.py``).
"""
