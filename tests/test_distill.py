"""End-to-end test of the draft distillation tool on a tiny random Llama built in-process."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from specexec_hf.models import vocab
from specexec_hf.models.drafts import build_draft, draft_config_from_target
from specexec_hf.tools import distill
from specexec_hf.tools.distill import export as export_stage
from specexec_hf.tools.distill import generate, sources, train

pytestmark = pytest.mark.slow  # whole distillation runs

CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|> {{ message['role'] }} {{ message['content'] }} <|im_end|> "
    "{% endfor %}{% if add_generation_prompt %}<|im_start|> assistant {% endif %}"
)
WORDS = "user assistant the a cat dog sat ran on mat big small red blue one two three what is why how tell me".split()


def make_tiny_target(directory: Path) -> None:
    """Save a random 4-layer Llama and a word-level chat tokenizer to ``directory``."""
    vocab = {token: index for index, token in enumerate(["<unk>", "<|im_start|>", "<|im_end|>", *WORDS])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", eos_token="<|im_end|>", pad_token="<|im_end|>"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(directory)
    config = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
        eos_token_id=vocab["<|im_end|>"],
        pad_token_id=vocab["<|im_end|>"],
    )
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(directory)


def write_prompts(path: Path, prompts: list[str]) -> None:
    lines = [json.dumps({"id": str(index), "category": "test", "prompt": text}) for index, text in enumerate(prompts)]
    path.write_text("\n".join(lines) + "\n")


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    distill.add_arguments(parser)
    return parser.parse_args(list(argv))


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("distill")
    make_tiny_target(root / "target")
    write_prompts(root / "train.jsonl", [f"tell me {w} {v}" for w in WORDS[2:10] for v in WORDS[10:13]])
    write_prompts(root / "eval.jsonl", ["what is the cat", "how big is one dog", "why red"])
    return root


def common_args(root: Path, *extra: str) -> argparse.Namespace:
    return parse(
        "--target", str(root / "target"), "--out", str(root / "run"), "--prompts", str(root / "train.jsonl"),
        "--eval-prompts", str(root / "eval.jsonl"), "--max-new-tokens", "12", "--top-k", "8",
        "--gen-batch-size", "8", "--layers", "2", "--batch-tokens", "128", "--warmup-steps", "2", *extra,
    )  # fmt: skip


def test_generate_train_resume_evaluate_export(tiny_run: Path) -> None:
    root = tiny_run
    assert distill.run(common_args(root, "--stage", "generate")) == 0
    shards = generate.shard_paths(root / "run" / "data")
    assert len(shards) == 6  # 24 prompts x (greedy + 1 sample) / batch 8
    rows = [row for path in shards for row in torch.load(path)["rows"]]
    greedy = next(row for row in rows if row["greedy"])
    assert greedy["topk_start"] == 0
    assert len(greedy["topk_ids"]) == len(greedy["input_ids"]) - 1
    # A greedy answer is the target's argmax at every answer position.
    answer_from = greedy["prompt_length"] - 1
    assert torch.equal(greedy["topk_ids"][answer_from:, 0], greedy["input_ids"][answer_from + 1 :])
    sampled = next(row for row in rows if not row["greedy"])
    assert sampled["topk_start"] == sampled["prompt_length"] - 1

    # Generating again finds every job done and writes nothing.
    assert generate.generate_data(common_args(root), *sources.load_target(str(root / "target"))) == 0

    assert distill.run(common_args(root, "--stage", "train", "--epochs", "1", "--holdout-shards", "1")) == 0
    first = torch.load(train.latest_checkpoint(root / "run"), weights_only=False)
    assert first["state"]["epoch"] == 1 or first["state"]["batch_in_epoch"] > 0
    assert distill.run(common_args(root, "--stage", "train", "--epochs", "2", "--holdout-shards", "1", "--resume")) == 0
    resumed = torch.load(train.latest_checkpoint(root / "run"), weights_only=False)
    assert resumed["state"]["step"] > first["state"]["step"]
    assert resumed["spec"] == {"num_hidden_layers": 2, "init_layers": [0, 3], "share_embeddings": True}
    assert not any("embed_tokens" in name or "lm_head" in name for name in resumed["draft"])

    # Resuming with a --draft-vocab loss scores fewer tokens: a new quantity, so the best val loss starts over.
    vocab_args = ("--holdout-shards", "1", "--resume", "--draft-vocab", "10")
    assert distill.run(common_args(root, "--stage", "train", "--epochs", "3", *vocab_args)) == 0
    restricted = torch.load(train.latest_checkpoint(root / "run"), weights_only=False)
    assert restricted["state"]["step"] > resumed["state"]["step"]
    assert restricted["state"]["draft_vocab"] == 10 and restricted["state"]["best_val"] == restricted["val_loss"]

    assert distill.run(common_args(root, "--stage", "export")) == 0
    report = json.loads((root / "run" / "agreement.json").read_text())
    assert {"top1_agreement", "top4_coverage", "positions", "prompts", "forward_cost"} <= report.keys()
    assert 0.0 <= report["top1_agreement"] <= report["top4_coverage"] <= 1.0
    meta = json.loads((root / "run" / "draft.json").read_text())
    assert meta["num_hidden_layers"] == 2 and meta["agreement"]["top1_agreement"] == report["top1_agreement"]

    target, _ = sources.load_target(str(root / "target"))
    weights = load_file(root / "run" / "draft.safetensors")
    assert all(tensor.dtype == torch.float16 for tensor in weights.values())
    assert "lm_head.token_ids" not in weights
    draft = build_draft(target, draft_config_from_target(target.config, meta["num_hidden_layers"]), weights)
    assert draft.get_input_embeddings().weight is target.get_input_embeddings().weight
    assert draft(input_ids=torch.tensor([[1, 5, 6]])).logits.shape == (1, 3, target.config.vocab_size)

    # --draft-vocab: the exported head scores only the tokens the target ranks high most often.
    small = root / "run" / "small.safetensors"
    assert distill.run(common_args(root, "--stage", "export", "--draft-vocab", "10", "--export-path", str(small))) == 0
    meta = json.loads(small.with_suffix(".json").read_text())
    assert meta["draft_vocab"] == meta["agreement"]["draft_vocab"] == 10
    weights = load_file(small)
    counts = generate.target_token_counts(root / "run" / "data", target.config.vocab_size)
    assert weights["lm_head.token_ids"].tolist() == sorted(counts.argsort(descending=True, stable=True)[:10].tolist())
    draft = build_draft(target, draft_config_from_target(target.config, meta["num_hidden_layers"]), weights)
    logits = draft(input_ids=torch.tensor([[1, 5, 6]])).logits
    assert torch.isfinite(logits).sum(-1).tolist() == [[10, 10, 10]]


def test_top_k_kl_is_zero_for_matching_distributions() -> None:
    logits = torch.randn(2, 3, 10)
    log_probs = torch.log_softmax(logits, dim=-1)
    values, ids = log_probs.topk(4, dim=-1)
    loss = train.top_k_kl(logits, ids, values, torch.ones(2, 3))
    assert abs(float(loss)) < 1e-5
    assert float(train.top_k_kl(torch.randn(2, 3, 10), ids, values, torch.ones(2, 3))) > 0


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**16),
    vocab_size=st.integers(4, 40),
    k=st.integers(1, 8),
    subset_fraction=st.floats(0.1, 1.0),
)
def test_top_k_kl_is_the_exact_kl_of_the_coarsened_distributions(
    seed: int, vocab_size: int, k: int, subset_fraction: float
) -> None:
    """With a --draft-vocab head, stored tokens outside it join the tail bucket: KL over that partition, exactly."""
    generator = torch.Generator().manual_seed(seed)
    k = min(k, vocab_size)
    target_log_probs = torch.log_softmax(3 * torch.randn(vocab_size, generator=generator, dtype=torch.float64), -1)
    topk_log_probs, topk_ids = target_log_probs.topk(k)
    subset = torch.randperm(vocab_size, generator=generator)[: max(1, int(subset_fraction * vocab_size))].sort().values
    scored = train.ScoredTokens(vocab_size, subset)
    draft_scores = torch.randn(subset.numel(), generator=generator, dtype=torch.float64)
    loss = train.top_k_kl(
        draft_scores.view(1, 1, -1), scored.column_of[topk_ids].view(1, 1, -1), topk_log_probs.view(1, 1, -1),
        torch.ones(1, 1),
    )  # fmt: skip

    draft_probs = torch.zeros(vocab_size, dtype=torch.float64)
    draft_probs[subset] = torch.softmax(draft_scores, -1)
    buckets = [int(token) for token in topk_ids if int(token) in set(subset.tolist())]
    target_buckets = target_log_probs.exp()[buckets]
    draft_buckets = draft_probs[buckets]
    # Both tails are clamped at 1e-6 (the loss's guard against log 0 when the top-k holds all the mass).
    target_tail, draft_tail = (1 - target_buckets.sum()).clamp(min=1e-6), (1 - draft_buckets.sum()).clamp(min=1e-6)
    expected = (target_buckets * (target_buckets / draft_buckets).log()).sum() + target_tail * (
        target_tail / draft_tail
    ).log()
    assert float(loss) == pytest.approx(float(expected), rel=1e-4, abs=1e-5)


def test_first_prompt_answers_only_the_later_prompts(tiny_run: Path) -> None:
    args = common_args(tiny_run, "--stage", "generate", "--first-prompt", "20", "--out", str(tiny_run / "late"))
    assert distill.run(args) == 0
    jobs = [job for path in generate.shard_paths(tiny_run / "late" / "data") for job in torch.load(path)["jobs"]]
    assert sorted(job["prompt_index"] for job in jobs) == [20, 20, 21, 21, 22, 22, 23, 23]


def test_bad_init_layers_are_rejected(tiny_run: Path) -> None:
    target, _ = sources.load_target(str(tiny_run / "target"))
    with pytest.raises(ValueError, match="--init-layers"):
        train.draft_spec_from_args(common_args(tiny_run, "--init-layers", "0,9"), target)


def test_draft_vocab_set_travels_with_the_checkpoint_and_the_export(tiny_run: Path) -> None:
    """Export gives the head the token set the draft was trained on, not a recount of data added since;
    --init-from continues from an export with its weights and its set."""
    out = tiny_run / "vocab_run"
    vocab_args = ("--out", str(out), "--draft-vocab", "10")
    assert distill.run(common_args(tiny_run, "--stage", "generate", "--out", str(out))) == 0
    assert distill.run(common_args(tiny_run, "--stage", "train", "--epochs", "1", *vocab_args)) == 0
    checkpoint_path = train.latest_checkpoint(out)
    checkpoint = torch.load(checkpoint_path, weights_only=False)
    target, _ = sources.load_target(str(tiny_run / "target"))
    counted = vocab.frequent_tokens(generate.target_token_counts(out / "data", target.config.vocab_size), 10)
    assert torch.equal(checkpoint["draft_token_ids"], counted)

    # Stand-in for shards added after training: a set the data would no longer pick.
    trained_with = torch.tensor(sorted(set(range(target.config.vocab_size)) - set(counted.tolist()))[:10])
    checkpoint["draft_token_ids"] = trained_with
    torch.save(checkpoint, checkpoint_path)
    export = out / "draft.safetensors"
    export_args = ("--stage", "export", "--checkpoint", str(checkpoint_path), *vocab_args)
    assert distill.run(common_args(tiny_run, *export_args)) == 0
    assert load_file(export)["lm_head.token_ids"].tolist() == trained_with.tolist()

    draft, spec, token_ids = train.load_exported_draft(export, target)
    assert spec.as_dict() == checkpoint["spec"] and token_ids.tolist() == trained_with.tolist()
    assert all(parameter.dtype == torch.float32 for parameter in draft.parameters())
    weights = {name: tensor.float() for name, tensor in load_file(export).items()}
    shipped = build_draft(target, draft_config_from_target(target.config, spec.num_hidden_layers), weights)
    restricted = vocab.restrict_draft_vocabulary(draft, token_ids)
    input_ids = torch.tensor([[1, 5, 6, 7]])
    assert torch.equal(restricted(input_ids=input_ids).logits, shipped(input_ids=input_ids).logits)

    continued = tiny_run / "continued_run"
    init_args = ("--out", str(continued), "--draft-vocab", "10", "--init-from", str(export))
    shutil.copytree(out / "data", continued / "data")
    assert distill.run(common_args(tiny_run, "--stage", "train", "--epochs", "1", *init_args)) == 0
    resumed = torch.load(train.latest_checkpoint(continued), weights_only=False)
    assert resumed["spec"] == checkpoint["spec"]
    assert resumed["draft_token_ids"].tolist() == trained_with.tolist()


def test_init_from_a_missing_export_names_the_option(tiny_run: Path) -> None:
    target, _ = sources.load_target(str(tiny_run / "target"))
    with pytest.raises(FileNotFoundError, match="--init-from"):
        train.load_exported_draft(tiny_run / "nowhere.safetensors", target)


def test_device_option_rejects_unusable_devices_before_loading_anything() -> None:
    with pytest.raises(ValueError, match="not a torch device name"):
        distill.resolve_device("gpu0")
    assert distill.resolve_device("cpu") == torch.device("cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="no CUDA GPU; use --device cpu"):
            distill.resolve_device("cuda")


def test_int8_export_ships_the_weights_its_report_describes(tiny_run: Path) -> None:
    """--export-dtype int8 stores matrices as int8 + per-row scales, loads them back dequantized, and its agreement
    report is measured on exactly those round-tripped weights."""
    out = tiny_run / "int8_run"
    run_args = ("--out", str(out), "--draft-vocab", "10")
    assert distill.run(common_args(tiny_run, "--stage", "generate", "--out", str(out))) == 0
    assert distill.run(common_args(tiny_run, "--stage", "train", "--epochs", "1", *run_args)) == 0
    half, packed = out / "half.safetensors", out / "packed.safetensors"
    export = ("--stage", "export", *run_args, "--export-path")
    assert distill.run(common_args(tiny_run, *export, str(half))) == 0
    assert distill.run(common_args(tiny_run, *export, str(packed), "--export-dtype", "int8")) == 0
    assert json.loads(packed.with_suffix(".json").read_text())["agreement"]["int8_weights"] is True
    assert json.loads(half.with_suffix(".json").read_text())["agreement"]["int8_weights"] is False

    stored = load_file(packed)
    matrices = [name for name, tensor in load_file(half).items() if tensor.ndim == 2]
    assert matrices and all(stored[name].dtype == torch.int8 for name in matrices)
    assert all(stored[name + ".int8_scale"].shape == (stored[name].shape[0],) for name in matrices)

    target, _ = sources.load_target(str(tiny_run / "target"))
    checkpoint_draft, spec, _ = train.load_checkpoint_draft(train.resolve_checkpoint(parse(*run_args)), target)
    loaded, _, _ = train.load_exported_draft(packed, target)
    input_ids = torch.tensor([[1, 5, 6, 7]])
    with torch.no_grad():
        unrounded = checkpoint_draft(input_ids=input_ids).logits
        export_stage.round_trip_int8(train.draft_weights(checkpoint_draft, spec))
        logits, expected = loaded(input_ids=input_ids).logits, checkpoint_draft(input_ids=input_ids).logits
    # Vectors (norm weights) ship as float16 like in any float16 export; that rounding is far below int8's.
    assert float((logits - expected).abs().max()) < 3e-4 < float((logits - unrounded).abs().max())


def test_exit_stage_tunes_an_adapter_that_lowers_the_loss_and_reports_both_exits(tiny_run: Path) -> None:
    out = tiny_run / "exit_run"
    assert distill.run(common_args(tiny_run, "--stage", "generate", "--out", str(out))) == 0
    with pytest.raises(ValueError, match="pass --exit-layers K"):
        distill.run(common_args(tiny_run, "--stage", "exit", "--out", str(out), "--epochs", "1"))
    tuned_args = ("--stage", "exit", "--out", str(out), "--exit-layers", "2", "--exit-rank", "8", "--epochs", "4",
                  "--lr", "3e-2")
    assert distill.run(common_args(tiny_run, *tuned_args)) == 0
    report = json.loads((out / "exit_report.json").read_text())
    assert report["trainable_parameters"] == 2 * 32 * 8 and report["steps"] > 0
    assert report["last_loss"] < report["first_loss"]
    for exit_kind in ("untrained", "tuned"):
        assert 0 <= report[exit_kind]["top1_agreement"] <= report[exit_kind]["top4_coverage"] <= 1
    target, _ = sources.load_target(str(tiny_run / "target"))
    from specexec_hf.models import load_tuned_exit

    draft = load_tuned_exit(target, out / "exit.safetensors")
    assert draft.config.num_hidden_layers == 2
    ids = torch.tensor([[3, 5, 7, 9]])
    expected = target.generate(ids, max_new_tokens=8, do_sample=False)
    got = target.generate(ids, max_new_tokens=8, do_sample=False, assistant_model=draft, speculator="specexec",
                          budget=6)
    assert got.tolist() == expected.tolist()
