"""``python -m benchmarks.gpu_offload``: :func:`benchmarks.gpu_offload.cli.main`."""

from benchmarks.gpu_offload.cli import main

raise SystemExit(main())
