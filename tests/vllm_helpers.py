"""What the vLLM test modules share: the proposer's import path, the prompts, the tiny pair and a `vllm serve` run."""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

PROPOSER = "specexec_hf.vllm.SpecExecProposer"
PROMPTS = ["the quick brown fox", "lazy dog", "a token tree grows by best first search over", "speculative"]
MAX_TOKENS = 24
SERVER_START_TIMEOUT_S = 240
REQUEST_TIMEOUT_S = 120


def tiny_pair(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tiny synthetic target and a noisy draft of it, saved as Hugging Face models (benchmarks/synthetic_models.py,
    which the benchmarks share)."""
    from benchmarks import synthetic_models

    return synthetic_models.make_tiny_pair(tmp_path_factory.mktemp("tiny"), noise=0.1)


@dataclass
class ServerRun:
    """What one ``vllm serve`` run answered: completion texts per prompt and its speculative-decoding counters."""

    texts: list[str]
    counters: dict[str, int]


def serve_completions(target: Path, log: Path, extra_args: list[str], extra_env: dict[str, str]) -> ServerRun:
    """Runs ``vllm serve`` on 127.0.0.1 (the serving benchmark's ``Server``), sends ``PROMPTS`` concurrently, reads
    its counters, and fails the test unless the server shuts down on SIGTERM."""
    from benchmarks import vllm_serving as serving

    args = ["--dtype", "float32", "--max-model-len", "256", "--max-num-seqs", str(len(PROMPTS)), "--enforce-eager",
            *extra_args]  # fmt: skip
    server = serving.Server(str(target), log, args, {**os.environ, **extra_env}, SERVER_START_TIMEOUT_S)
    try:
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            answers = list(pool.map(lambda prompt: server.complete(prompt, MAX_TOKENS, REQUEST_TIMEOUT_S), PROMPTS))
        counters = server.spec_counters()
    finally:
        stopped_on_sigterm = server.stop()
    if not stopped_on_sigterm:
        pytest.fail(f"vllm serve did not shut down on SIGTERM:\n{serving.log_tail(log)}")
    return ServerRun([answer[0] for answer in answers], counters)  # complete() answers (text, tokens, timings...)
