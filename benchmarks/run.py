"""The benchmark grid of ``specexec-hf bench``, runnable from a checkout.

Run: .venv/bin/python -m benchmarks.run [--prompts 8] [--max-new-tokens 64] [--budgets 16 32 ...] [--help]
"""

import sys

from specexec_hf.tools.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
