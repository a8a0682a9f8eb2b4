"""benchmarks/vllm_serving.py: its pure parts (the event stream, the comparison with the unspeculated server, the
goals, the tree's server arguments, the argument checks), and on the synthetic tiny pair three `vllm serve` runs
(none, draft_model, SpecExec trees) whose greedy texts must agree, with speculation that commits more than one token
per target step.

The end-to-end test's servers take 40-60 s each to start on the 2-core CPU machine, so it takes about 3 minutes.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from benchmarks import vllm_serving


def sse(chunks: list[dict], trailing: list[dict]) -> io.BytesIO:
    """A server-sent event stream of ``chunks``, then ``data: [DONE]``, then ``trailing`` (never read)."""
    lines = [b": keep-alive\n", b"\n"]
    for chunk in chunks:
        lines += [f"data: {json.dumps(chunk)}\n".encode(), b"\n"]
    lines.append(b"data: [DONE]\n")
    lines += [f"data: {json.dumps(chunk)}\n".encode() for chunk in trailing]
    return io.BytesIO(b"".join(lines))


@given(st.lists(st.text(max_size=5), max_size=8), st.integers(0, 100))
def test_stream_chunks_give_the_pieces_in_order_and_stop_at_done(pieces, tokens):
    chunks = [{"choices": [{"text": piece}]} for piece in pieces]
    chunks.append({"choices": [], "usage": {"completion_tokens": tokens}})
    read = list(vllm_serving.stream_chunks(sse(chunks, trailing=[{"choices": [{"text": "after done"}]}])))
    assert read == chunks
    assert "".join(c["choices"][0]["text"] for c in read if c["choices"]) == "".join(pieces)


def request(text: str, latency: float = 2.0, first: float = 0.5, tokens: int = 4) -> object:
    return vllm_serving.RequestResult(0, latency, first, tokens, text)


def result(
    method: str, concurrency: int, tok_s: float, texts: list[str], budget: int | str | None = None,
    request_budget: int | None = None,
) -> object:
    """A measured configuration with only the fields the comparisons read set to something meaningful."""
    return vllm_serving.MethodResult(
        method=method, concurrency=concurrency, budget=budget, request_budget=request_budget or budget,
        k=4 if method == "draft_model"
        else None, server_start_s=1.0, wall_s=1.0, completion_tokens=4 * len(texts), output_tokens_per_s=tok_s,
        mean_latency_s=1.0, median_latency_s=1.0, mean_first_token_s=0.1, mean_time_per_output_token_s=0.1,
        drafts=0, draft_tokens=0, accepted_tokens=0, tokens_per_target_step=None, delivered_tokens_per_step=None,
        outputs_equal_none=None, requests_equal_none=None, log="x.log", worker_cores=None, memory=None,
        disconnects=None, requests=[request(text) for text in texts],
    )  # fmt: skip


def test_time_per_output_token_excludes_the_first_token():
    assert request("a", latency=3.5, first=0.5, tokens=7).time_per_output_token_s == pytest.approx(0.5)
    assert request("a", latency=3.5, first=0.5, tokens=1).time_per_output_token_s == 3.5


def test_outputs_are_compared_with_the_unspeculated_server_at_the_same_concurrency():
    results = [
        result("none", 1, 4.0, ["a", "b"]),
        result("none", 8, 9.0, ["a", "c"]),  # batching may change a text: each concurrency has its own reference
        result("specexec_tree", 8, 9.0, ["a", "c"], budget=64),
        result("draft_model", 1, 3.0, ["a", "x"]),
        result("specexec_tree", 4, 2.0, ["a", "b"], budget=16),  # no none at 4 clients
    ]
    vllm_serving.compare_with_none(results)
    assert [(r.outputs_equal_none, r.requests_equal_none) for r in results] == [
        (True, 2), (True, 2), (True, 2), (False, 1), (None, None)
    ]  # fmt: skip
    table = vllm_serving.markdown_table(results)
    assert "| **1/2** |" in table and "| 8 | specexec_tree | budget 64 | 9.00 | 1.00x | - |" in table


def test_goals_take_the_best_tree_budget_and_skip_what_was_not_measured():
    results = [
        result("none", 1, 2.0, ["a"]),
        result("draft_model", 1, 3.0, ["a"]),
        result("specexec_tree", 1, 4.5, ["a"], budget=16),
        result("specexec_tree", 1, 3.5, ["a"], budget=64),
        result("specexec_tree_int8", 1, 4.0, ["a"], budget=32),
        result("specexec_tree", 8, 20.0, ["a"], budget=64),  # no none with 8 clients: that goal is not measured
    ]
    tree = {"best_tree_method": "specexec_tree", "best_tree_budget": 16}
    assert vllm_serving.goals(results) == [
        {"goal": "1 client(s): trees >= 2.0x none", **tree, "ratio": 2.25, "met": True},
        {"goal": "1 client(s): trees >= 1.5x draft_model", **tree, "ratio": 1.5, "met": True},
    ]
    results.append(result("specexec_tree_int8", 1, 6.0, ["a"], budget=32))  # either kind of tree draft counts
    assert vllm_serving.goals(results)[0]["best_tree_method"] == "specexec_tree_int8"
    results.append(result("none", 8, 16.0, ["a"]))
    assert vllm_serving.goals(results)[-1] == {
        "goal": "8 client(s): trees >= 1.3x none", "best_tree_method": "specexec_tree", "best_tree_budget": 64,
        "ratio": 1.25, "met": False,
    }  # fmt: skip
    results += [result("none", 4, 10.0, ["a"]), result("specexec_tree_int8", 4, 14.0, ["a"], "auto", 48)]
    assert vllm_serving.goals(results)[2] == {
        "goal": "4 client(s): trees >= 1.3x none", "best_tree_method": "specexec_tree_int8", "best_tree_budget": "auto",
        "ratio": 1.4, "met": True,
    }  # fmt: skip
    assert "| 4 | specexec_tree_int8 | budget auto (48 per request) | 14.00 |" in vllm_serving.markdown_table(results)


@pytest.mark.parametrize(("budget", "cap", "per_request"), [(64, None, 64), (256, 32, 32), (16, 32, 16)])
def test_a_tree_server_shares_the_budget_per_step(budget, cap, per_request):
    args = vllm_serving.parse_args(["--budgets", str(budget), *(["--request-budget", str(cap)] if cap else [])])
    command = vllm_serving.server_args("specexec_tree", args, "DRAFT", budget, concurrency=8)
    config = json.loads(command[command.index("--speculative-config") + 1])
    settings = config["draft_load_config"]["model_loader_extra_config"]["specexec"]
    assert (config["num_speculative_tokens"], settings["budget"], settings["step_budget"]) == (per_request, per_request,
                                                                                              budget)  # fmt: skip
    assert settings["tree_verification"] is True
    assert command[command.index("--max-num-seqs") + 1] == "8"
    assert "--speculative-config" not in vllm_serving.server_args("none", args, "DRAFT", 0, concurrency=8)


def test_request_budgets_pair_with_the_step_budgets(capsys):
    """One --request-budget caps every budget; several pair with --budgets in order; other counts are refused."""
    args = vllm_serving.parse_args(["--budgets", "8", "16", "32", "--request-budget", "1", "2", "64"])
    assert [vllm_serving.request_budget(args, b) for b in args.budgets] == [1, 2, 32]
    args = vllm_serving.parse_args(["--budgets", "8", "16", "--request-budget", "4"])
    assert [vllm_serving.request_budget(args, b) for b in args.budgets] == [4, 4]
    for bad in (["--budgets", "8", "16", "--request-budget", "1", "2", "3"],
                ["--budgets", "8", "8", "--request-budget", "1", "2"]):  # fmt: skip
        with pytest.raises(SystemExit):
            vllm_serving.parse_args(bad)
        assert "one per budget" in capsys.readouterr().err


def test_an_automatic_step_budget_caps_each_request_s_tree(capsys):
    """--budgets auto: the proposer's step_budget "auto", each request's tree at --request-budget (the only cap it
    has, so one must be given); numbers beside it keep their meaning."""
    args = vllm_serving.parse_args(["--budgets", "auto", "64", "--request-budget", "48"])
    assert args.budgets == ["auto", 64]
    assert [vllm_serving.request_budget(args, b) for b in args.budgets] == [48, 48]
    command = vllm_serving.server_args("specexec_tree_int8", args, "DRAFT", "auto", concurrency=4)
    config = json.loads(command[command.index("--speculative-config") + 1])
    settings = config["draft_load_config"]["model_loader_extra_config"]["specexec"]
    assert (config["num_speculative_tokens"], settings["budget"], settings["step_budget"]) == (48, 48, "auto")
    for bad, message in ((["--budgets", "auto"], "give --request-budget"), (["--budgets", "0"], "positive number"),
                         (["--budgets", "most"], "or 'auto'")):  # fmt: skip
        with pytest.raises(SystemExit):
            vllm_serving.parse_args(bad)
        assert message in capsys.readouterr().err


def test_bad_offload_arguments_are_refused_before_any_server_starts(tmp_path, capsys):
    with pytest.raises(SystemExit):
        vllm_serving.parse_args(["--cache-fraction", "0.3"])
    assert "pass --offload FOLDER too" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        vllm_serving.parse_args(["--offload", str(tmp_path / "missing")])
    assert "no such folder" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        vllm_serving.parse_args(["--offload", str(tmp_path), "--cache-fraction", "1.5"])
    assert "a fraction in [0, 1)" in capsys.readouterr().err


def test_tree_draft_settings_reach_the_proposer(tmp_path):
    """--draft-dtype and --draft-vocab go to the tree proposer's settings only; specexec_tree_int8 sets draft_int8."""
    args = vllm_serving.parse_args(["--draft-vocab", "vocab.json", "--draft-dtype", "bfloat16"])
    for method, int8 in (("specexec_tree", False), ("specexec_tree_int8", True)):
        command = vllm_serving.server_args(method, args, "DRAFT", 16, concurrency=1)
        config = json.loads(command[command.index("--speculative-config") + 1])
        settings = config["draft_load_config"]["model_loader_extra_config"]["specexec"]
        assert (settings["draft_vocab"], settings["draft_dtype"], settings["draft_int8"]) == ("vocab.json", "bfloat16",
                                                                                             int8)
        assert config["method"] == "custom_class" and settings["step_budget"] == 16
    draft_model = vllm_serving.server_args("draft_model", args, "DRAFT", 16, concurrency=1)
    assert "vocab.json" not in draft_model[draft_model.index("--speculative-config") + 1]


@pytest.mark.vllm
def test_the_default_pair_s_draft_vocabulary_is_written_where_the_proposer_reads_it(tmp_path):
    """Into the exported draft's folder, where the proposer reads it by default."""
    pytest.importorskip("vllm")
    from specexec_hf.integrations.vllm import ProposerSettings, read_token_ids

    path = vllm_serving.shipped_draft_vocab(tmp_path)
    shipped = read_token_ids(str(path))
    assert shipped.numel() == 8192 and shipped.unique().numel() == 8192
    assert ProposerSettings.from_sources({"draft_model": str(tmp_path)}, {}).draft_vocab == str(path)


@pytest.mark.slow
@pytest.mark.vllm
def test_serving_benchmark_on_the_tiny_pair(vllm_env, tmp_path):
    output = tmp_path / "serving.json"
    vllm_serving.main(
        ["--requests", "4", "--concurrency", "2", "--max-tokens", "16", "--budgets", "16", "-k", "4",
         "--output", str(output)]
    )  # fmt: skip
    report = json.loads(output.read_text())
    assert (report["concurrency"], report["requests"], report["max_tokens"], report["failed"]) == ([2], 4, 16, [])
    results = {(r["method"], r["budget"]): r for r in report["results"]}
    assert set(results) == {("none", None), ("draft_model", None), ("specexec_tree", 16)}
    for (method, _), result in results.items():
        assert result["outputs_equal_none"] is True, method
        assert result["requests_equal_none"] == 4
        assert result["completion_tokens"] == 4 * 16
        assert all(request["text"] for request in result["requests"])
        assert result["output_tokens_per_s"] > 0 and result["mean_latency_s"] > 0
        assert 0 < result["mean_time_per_output_token_s"] < result["mean_latency_s"]
        assert Path(result["log"]).is_file()
    assert results[("none", None)]["drafts"] == 0
    for key in (("draft_model", None), ("specexec_tree", 16)):
        assert results[key]["tokens_per_target_step"] > 1
        assert results[key]["delivered_tokens_per_step"] > 1
    assert output.with_suffix(".md").read_text().startswith("| clients | method |")


@given(st.integers(0, 50_000), st.integers(-2_000, 2_000), st.integers(20, 600))
def test_memory_growth_is_the_slope_over_the_second_half(base, per_request, requests):
    warm_up_jump = 10**8  # memory taken in the first half does not count as growth
    samples = [[0, base, 0]] + [
        [finished, base + per_request * finished + (0 if finished > requests // 5 else -warm_up_jump), 0]
        for finished in range(1, requests + 1)
    ]
    figures = vllm_serving.MemoryFigures(weights_bytes=1, held_bytes=1, limit_bytes=1, samples=samples)
    assert figures.growth_bytes_per_request == pytest.approx(per_request, abs=1e-6)
    assert vllm_serving.MemoryFigures(1, 1, 1, samples=samples[:5]).growth_bytes_per_request is None
