"""`specexec-hf generate` and `specexec-hf bench` with a user's own target and draft (Hugging Face directories),
in memory and offloaded; the option checks; and every `specexec-hf` command the README and docs show."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
from pathlib import Path

import pytest
from conftest import perturbed_copy, tiny_model, tiny_tokenizer

from specexec_hf.hf import autobudget
from specexec_hf.tools import bench, cli
from specexec_hf.tools.bench import _pretrained as pretrained
from specexec_hf.tools.bench import load_models, memory_budget
from specexec_hf.tools.prompts import chat_inputs

PROMPT = "the quick brown fox"
NEW_TOKENS = 16
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"
REPOSITORY = Path(__file__).resolve().parents[1]
SUBCOMMANDS = ("generate", "distill", "bench", "calibrate")
OFFLOADS = [[], ["--offload", "stream"], ["--offload", "accelerate"]]


@pytest.fixture(autouse=True)
def private_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECEXEC_HF_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(autobudget, "_profiles", {})


@pytest.fixture(scope="module")
def pair(tmp_path_factory) -> tuple[Path, Path]:
    """A tiny random target and a noisy copy of it as its draft, each saved as a Hugging Face directory with a
    character-level chat tokenizer."""
    root = tmp_path_factory.mktemp("pair")
    target = tiny_model("llama", seed=0)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    for name, model in (("target", target), ("draft", perturbed_copy(target, 0.05, seed=1))):
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root / "target", root / "draft"


@pytest.fixture(scope="module")
def plain_greedy_text(pair) -> str:
    """The target's plain greedy answer, computed here without the command line."""
    target_dir, _ = pair
    target = tiny_model("llama", seed=0)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHAT_TEMPLATE
    inputs = chat_inputs(tokenizer, PROMPT)
    output = target.generate(**inputs, max_new_tokens=NEW_TOKENS, do_sample=False)
    text = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert text.strip(), "the tiny target should answer with some visible characters"
    return text


def generate(capsys, *options: str) -> tuple[str, str]:
    """Runs `specexec-hf generate` in this process; returns its stdout (the answer) and stderr (the report)."""
    assert cli.main(["generate", "--prompt", PROMPT, "--max-new-tokens", str(NEW_TOKENS), *options]) == 0
    captured = capsys.readouterr()
    return captured.out, captured.err


@pytest.mark.parametrize("offload", OFFLOADS, ids=["in-memory", "stream", "accelerate"])
def test_generate_with_own_target_and_draft_equals_plain_greedy(pair, plain_greedy_text, offload, capsys):
    target_dir, draft_dir = pair
    answer, report = generate(capsys, "--target", str(target_dir), "--draft", str(draft_dir), "--budget", "6", *offload)
    assert answer == plain_greedy_text + "\n"
    assert "tokens per target forward" in report
    plain_answer, plain_report = generate(capsys, "--target", str(target_dir), "--no-specexec", *offload)
    assert plain_answer == plain_greedy_text + "\n"
    assert "tokens per target forward" not in plain_report


@pytest.mark.parametrize("draft", ["target", "self:exit:1"])
def test_generate_offloaded_target_with_a_draft_made_from_it(pair, plain_greedy_text, draft, capsys):
    """`--draft target` and the layer self-drafts are built from the target in memory; the target that runs is
    offloaded all the same."""
    target_dir, _ = pair
    answer, _ = generate(capsys, "--target", str(target_dir), "--draft", draft, "--offload", "stream",
                         "--max-memory", "cpu=0")  # fmt: skip
    assert answer == plain_greedy_text + "\n"


@pytest.mark.parametrize("offload", OFFLOADS[:2], ids=["in-memory", "stream"])
def test_bench_with_own_target_and_draft_matches_greedy(pair, tmp_path, offload, capsys):
    target_dir, draft_dir = pair
    out = tmp_path / "bench"
    code = cli.main([
        "bench", "--target", str(target_dir), "--draft", str(draft_dir), "--methods", "autoregressive", "specexec",
        "specexec_rounds", "--budgets", "6", "--temperatures", "0", "--prompts", "2", "--max-new-tokens", "8",
        "--threads", "1",
        "--out", str(out), *offload,
    ])  # fmt: skip
    assert code == 0
    report = json.loads((out / "bench.json").read_text())
    assert report["models"]["target"]["name"] == str(target_dir)
    assert report["models"]["draft"]["name"] == str(draft_dir)
    assert report["models"]["target"]["offload"] == (offload[1] if offload else None)
    (autoregressive, *trees) = report["results"]
    assert [tree["method"] for tree in trees] == ["specexec", "specexec_rounds"]
    for tree in trees:
        assert autoregressive["new_tokens"] == tree["new_tokens"] == 16
        assert tree["matches_autoregressive"] is True


def test_offloaded_target_is_not_loaded_in_memory_for_a_draft_directory(pair, monkeypatch):
    """With a draft directory, --offload never loads the target whole: only the draft goes through from_pretrained,
    and every decoder layer of the target stays on disk."""
    target_dir, draft_dir = pair
    loaded = []
    monkeypatch.setattr(bench, "_pretrained", lambda path, option: loaded.append(option) or pretrained(path, option))
    args = cli.build_parser().parse_args(
        ["generate", "--prompt", PROMPT, "--target", str(target_dir), "--draft", str(draft_dir), "--offload", "stream"]
    )
    target, draft, _, info = load_models(args)
    assert loaded == ["--draft"]
    assert {where for name, where in target.hf_device_map.items() if ".layers." in name} == {"disk"}
    assert info["target"]["offload"] == "stream" and info["target"]["max_memory"] == {"cpu": 0}
    assert draft.device.type == "cpu"


@pytest.mark.parametrize("offload", OFFLOADS, ids=["in-memory", "stream", "accelerate"])
def test_a_tied_head_counts_once(tmp_path, offload):
    """The reported size of a target whose head is tied to its embedding does not change when it is offloaded."""
    config = tiny_model("llama").config
    config.tie_word_embeddings = True
    model = type(tiny_model("llama"))(config)
    model.save_pretrained(tmp_path / "tied")
    tiny_tokenizer().save_pretrained(tmp_path / "tied")
    args = cli.build_parser().parse_args(["generate", "--prompt", PROMPT, "--target", str(tmp_path / "tied"),
                                          "--no-specexec", *offload])  # fmt: skip
    _, _, _, info = load_models(args, with_draft=False)
    assert info["target"]["parameters"] == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize(
    "options, message",
    [
        (["--max-memory", "cpu=0"], "add --offload"),
        (["--offload-folder", "somewhere"], "add --offload"),
        (["--target", "TARGET"], "--target needs --draft"),
        (["--target", "TARGET", "--draft", "default"], "distilled for the default target"),
        (["--draft", "truncated:many"], "takes a positive number of layers"),
    ],
)
def test_options_that_do_not_go_together_are_refused_before_loading(options, message):
    args = cli.build_parser().parse_args(["generate", "--prompt", PROMPT, *options])
    with pytest.raises(SystemExit, match=re.escape(message)):
        load_models(args)


def test_unloadable_draft_names_the_option(pair, tmp_path):
    target_dir, _ = pair
    args = cli.build_parser().parse_args(
        ["generate", "--prompt", PROMPT, "--target", str(target_dir), "--draft", str(tmp_path / "missing")]
    )
    with pytest.raises(SystemExit, match=r"--draft .*missing: cannot load it"):
        load_models(args)


@pytest.mark.parametrize(
    "entry, expected",
    [("cpu=0", ("cpu", 0)), ("0=6GiB", (0, "6GiB")), ("cpu = 300MiB", ("cpu", "300MiB")), ("1=1024", (1, 1024))],
)
def test_memory_budget_entries(entry, expected):
    assert memory_budget(entry) == expected


@pytest.mark.parametrize("entry", ["cpu", "=1GiB", "cpu=", "cpu=lots", "0=6 apples"])
def test_bad_memory_budget_entries_are_refused_with_the_format(entry, capsys):
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["generate", "--prompt", PROMPT, "--offload", "stream", "--max-memory", entry])
    error = capsys.readouterr().err
    assert "DEVICE=SIZE" in error or "is not a size" in error


def documented_commands() -> list[tuple[str, str, bool]]:
    """Every command line of `specexec-hf` (or `benchmarks/run.py`, its `bench`) with options in README.md and
    docs/*.md, as ``(file, command, complete)``: code-block lines (backslash continuations joined, shell variables
    set in the block expanded) are complete commands, inline code spans may be fragments that leave out required
    options."""
    command = re.compile(r"^(\S*/)?(specexec-hf [a-z]+|python benchmarks/run\.py) -")
    fence = re.compile(r"```[^\n]*\n(.*?)```", flags=re.S)
    found = []
    for path in [REPOSITORY / "README.md", *sorted((REPOSITORY / "docs").glob("*.md"))]:
        text = path.read_text()
        for block in fence.findall(text):
            variables = {}  # a block's `D="specexec-hf distill ..."` lines, used as `$D --stage ...`
            for line in block.replace("\\\n", " ").splitlines():
                assignment = re.fullmatch(r'(\w+)="(.*)"', line.strip())
                if assignment:
                    variables[assignment[1]] = assignment[2]
                line = re.sub(r"^\$(\w+)", lambda name, known=variables: known.get(name[1], name[0]), line.strip())
                if command.match(line):
                    found.append((path.name, line, True))
        found += [(path.name, span, False) for span in re.findall(r"`([^`\n]+)`", fence.sub("", text))
                  if command.match(span)]  # fmt: skip
    return found


def test_documented_commands_are_found():
    subcommands = {"bench" if "run.py" in line else line.split()[1] for _, line, _ in documented_commands()}
    assert subcommands == set(SUBCOMMANDS)


@pytest.mark.parametrize("where, command, complete", documented_commands(), ids=lambda value: str(value)[:70])
def test_documented_commands_parse(where, command, complete):
    """The README's and docs' commands name options the command line takes, with values it accepts (placeholders
    such as TARGET_DIR stand for any string); a fragment in prose may leave out required options."""
    words = shlex.split(command, comments=True)
    argv = ["bench", *words[2:]] if words[1] == "benchmarks/run.py" else words[1:]
    parser = cli.build_parser()
    if not complete:
        (subcommands,) = [action for action in parser._actions if isinstance(action, argparse._SubParsersAction)]
        for action in subcommands.choices[argv[0]]._actions:
            action.required = False
    try:
        parser.parse_args(argv)
    except SystemExit as exit:
        assert exit.code == 0, f"{where}: `{command}` does not parse"


def refusal(capsys, *options: str) -> str:
    """Runs `specexec-hf generate` with ``options``, expecting a refusal; returns its one line on stderr."""
    capsys.readouterr()  # what came before, such as the progress bars of models being saved
    with pytest.raises(SystemExit) as exit:
        cli.main(["generate", "--prompt", PROMPT, *options])
    assert exit.value.code == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("specexec-hf generate: error: ") and captured.err.count("\n") == 1, captured.err
    return captured.err


@pytest.fixture
def nothing_loads(monkeypatch):
    """Fails the test when the command gets as far as loading a model."""

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the options were checked")

    monkeypatch.setattr(bench, "load_models", refuse)


@pytest.fixture(scope="module")
def other_tokenizer_draft(tmp_path_factory) -> Path:
    """A draft whose character-level tokenizer covers 48 characters, where the pair's covers 64."""
    path = tmp_path_factory.mktemp("other_tokenizer")
    tiny_model("llama", seed=3, vocab_size=48).save_pretrained(path)
    tiny_tokenizer(vocab_size=48).save_pretrained(path)
    return path


def test_budget_auto_is_taken(pair, plain_greedy_text, capsys):
    target_dir, draft_dir = pair
    answer, report = generate(capsys, "--target", str(target_dir), "--draft", str(draft_dir), "--budget", "auto")
    assert answer == plain_greedy_text + "\n"
    assert "tokens per target forward" in report


@pytest.mark.parametrize(
    "option, value",
    [("--budget", "0"), ("--budget", "-2"), ("--budget", "many"), ("--max-new-tokens", "0"), ("--max-depth", "0"),
     ("--max-branch", "-1"), ("--temperature", "-0.5"), ("--temperature", "nan"), ("--top-p", "0"),
     ("--top-p", "1.5")],
)  # fmt: skip
def test_bad_numbers_are_refused_in_one_line_before_loading(option, value, nothing_loads, capsys):
    assert f"argument {option}: expected" in refusal(capsys, option, value)


@pytest.mark.parametrize(
    "draft, message",
    [
        ("{tmp}/missing", r"--draft \S+missing: no such directory, nor a model of that name .*'truncated:N'"),
        ("{tmp}", r"--draft \S+: a directory without a model's config.json"),
        ("self:int3", r"--draft self:int3: no such directory"),
        ("{tmp}/draft.safetensors", r"expected a .safetensors draft export beside its .json"),
        ("truncated:3", r"--draft truncated:3: the target has 2 layers; take at most truncated:2"),
        ("self:exit:3", r"--draft 'self:exit:3': K must be a whole number of layers from 1 to 2"),
        ("self:skip:0-1", r"--draft 'self:skip:0-1' skips all 2 decoder layers"),
    ],
)
def test_unusable_drafts_are_refused_in_one_line_before_loading(pair, tmp_path, draft, message, nothing_loads, capsys):
    target_dir, _ = pair
    assert re.search(message, refusal(capsys, "--target", str(target_dir), "--draft", draft.format(tmp=tmp_path)))


def test_a_missing_target_is_refused_in_one_line_before_loading(tmp_path, nothing_loads, capsys):
    error = refusal(capsys, "--target", str(tmp_path / "missing"), "--no-specexec")
    assert "--target" in error and "no such directory" in error


def test_a_target_without_its_tokenizer_is_refused_in_one_line_before_loading(tmp_path, nothing_loads, capsys):
    tiny_model("llama").save_pretrained(tmp_path / "bare")
    assert "no tokenizer there" in refusal(capsys, "--target", str(tmp_path / "bare"), "--no-specexec")


def test_a_draft_with_another_tokenizer_is_refused_naming_the_mismatch(pair, other_tokenizer_draft, nothing_loads,
                                                                      capsys):  # fmt: skip
    target_dir, _ = pair
    error = refusal(capsys, "--target", str(target_dir), "--draft", str(other_tokenizer_draft))
    assert "The draft's tokenizer is not the target's" in error and "48 entries against 64" in error


def test_refusals_of_load_models_end_in_one_line(capsys):
    assert "add --offload" in refusal(capsys, "--max-memory", "cpu=0")


def write_draft_export(target, path: Path) -> Path:
    """A one-layer draft for ``target`` in the export format (``specexec-hf distill --stage export``)."""
    from safetensors.torch import save_file
    from transformers import LlamaForCausalLM

    from specexec_hf.models.drafts import draft_config_from_target, own_state_dict

    draft = LlamaForCausalLM(draft_config_from_target(target.config, num_hidden_layers=1)).to(target.dtype)
    save_file(own_state_dict(draft), str(path))
    path.with_suffix(".json").write_text(json.dumps({"num_hidden_layers": 1}))
    return path


def test_a_draft_export_loads_from_a_str_path(tmp_path):
    from specexec_hf.models import load_draft_export

    target = tiny_model("llama", seed=0)
    draft = load_draft_export(target, str(write_draft_export(target, tmp_path / "draft.safetensors")))
    assert draft.config.num_hidden_layers == 1
    assert draft.get_input_embeddings() is target.get_input_embeddings()


@pytest.fixture
def tiny_default_pair(pair, tmp_path, monkeypatch) -> Path:
    """The pair's target stands for the default target (converted already, in the private cache), and a one-layer
    export of a draft for it for the shipped draft."""
    from specexec_hf.models import default_pair

    target_dir, _ = pair
    shutil.copytree(target_dir, default_pair.target_cache_dir())
    export = write_draft_export(tiny_model("llama", seed=0), tmp_path / "shipped.safetensors")
    monkeypatch.setattr(default_pair, "DRAFT_WEIGHTS_PATH", export)
    monkeypatch.setattr(default_pair, "DRAFT_META_PATH", export.with_suffix(".json"))
    return target_dir


def test_draft_default_takes_a_saved_copy_of_the_default_target(tiny_default_pair, plain_greedy_text, tmp_path,
                                                                capsys):  # fmt: skip
    copy = shutil.copytree(tiny_default_pair, tmp_path / "copy")
    answer, report = generate(capsys, "--target", str(copy), "--draft", "default", "--budget", "4")
    assert answer == plain_greedy_text + "\n"
    assert "tokens per target forward" in report


def test_draft_default_for_another_target_is_refused_without_offering_default(tiny_default_pair, tmp_path,
                                                                             nothing_loads, capsys):  # fmt: skip
    other = tmp_path / "other"
    tiny_model("llama", seed=0, num_layers=3).save_pretrained(other)
    tiny_tokenizer().save_pretrained(other)
    error = refusal(capsys, "--target", str(other), "--draft", "default")
    assert "is another model (its config or tokenizer differs)" in error
    assert "'default'" not in error
