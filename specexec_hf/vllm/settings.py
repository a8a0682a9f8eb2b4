"""The proposer's settings: the ``"specexec"`` dict of ``draft_load_config.model_loader_extra_config`` merged with
``SPECEXEC_*`` environment variables (see :mod:`.proposer` for what each does)."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, Literal

import torch

from ..core.config import SpecExecConfig
from ..core.search import tree_policy

# Key under draft_load_config.model_loader_extra_config, and prefix of the environment variables.
CONFIG_KEY = "specexec"
ENV_PREFIX = "SPECEXEC_"
# A draft folder holding this file (a JSON list of token ids) was distilled to score only those tokens: the proposer
# restricts its head to them unless ``draft_vocab`` says otherwise (``export_default_pair`` writes it for the
# shipped draft, whose exported head is widened to the full vocabulary for vLLM's loader).
DRAFT_VOCAB_FILE = "specexec_draft_vocab.json"
# ``step_budget`` value that chooses each step's total of tree nodes (see :mod:`.step_costs`).
AUTO = "auto"
# ``draft_vocab`` value that keeps the draft's whole head even where its folder holds DRAFT_VOCAB_FILE.
FULL_VOCABULARY = "all"


@dataclass(frozen=True)
class ProposerSettings:
    """What the proposer loads and how it grows trees.

    Args:
        draft_model: Path or hub id of the draft, a causal LM sharing the target's tokenizer.
        draft_dtype: Torch dtype name for the draft (``"float32"``, ``"bfloat16"``...); ``None``: see
            :func:`~.proposer.engine_draft_dtype`.
        specexec: Tree-growth knobs; ``max_depth`` is further capped by ``num_speculative_tokens``.
        tree_verification: Propose the whole tree and verify it in one target forward
            (:mod:`.tree_verifier`) instead of its best chain.
        offload: The target's decoder layers are written to this folder at load and streamed from it
            (:mod:`.offload`); ``None`` keeps them in memory.
        offload_prefetch: Layers the stream reads ahead of the one computing.
        step_budget: With tree verification, the tree nodes of one step in all: every request grows its tree up to
            ``budget`` nodes, then the trees are cut to the ``step_budget`` best nodes of them all
            (:func:`~specexec_hf.core.step_budget.share_budget`); ``"auto"``: each step's total is the one
            forecast to commit the most tokens per second, from the target forward's cost as the engine measures
            it (:mod:`.step_costs`); ``None``: ``budget`` nodes per request.
        tree_search: The tree policy's registered name (:data:`~specexec_hf.core.search.TREE_POLICIES`).
        draft_vocab: A JSON file holding a list of token ids: the draft's LM head scores only those tokens and
            proposes no other (:func:`~specexec_hf.models.vocab.restrict_draft_vocabulary`, what the shipped draft's
            head does in ``generate()``); ``None`` scores the whole vocabulary. :meth:`from_sources` fills it from
            the draft folder's :data:`DRAFT_VOCAB_FILE` when the setting is unset.
        draft_int8: Compute the draft's decoder layers in int8 (:func:`~specexec_hf.models.int8_draft.int8_draft`:
            a float32 Llama draft on the CPU); it changes the proposals only.
    """

    draft_model: str
    draft_dtype: str | None
    specexec: SpecExecConfig
    tree_verification: bool = False
    offload: str | None = None
    offload_prefetch: int = 1
    step_budget: int | Literal["auto"] | None = None
    tree_search: str = "specexec"
    draft_vocab: str | None = None
    draft_int8: bool = False

    @classmethod
    def from_sources(cls, extra: Mapping[str, Any], environ: Mapping[str, str]) -> ProposerSettings:
        """Merges ``SPECEXEC_*`` environment variables with the JSON settings, which win.

        Args:
            extra: The ``"specexec"`` dict of ``draft_load_config.model_loader_extra_config``.
            environ: The environment, e.g. ``os.environ``.
        """
        knobs = SpecExecConfig.knob_names()
        names = (
            "draft_model", "draft_dtype", "tree_verification", "offload", "offload_prefetch", "step_budget",
            "tree_search", "draft_vocab", "draft_int8", *knobs,
        )  # fmt: skip
        unknown = sorted(set(extra) - set(names))
        if unknown:
            raise ValueError(f"Unknown SpecExec vLLM setting(s) {unknown}; known: {list(names)}.")
        raw = {name: environ[ENV_PREFIX + name.upper()] for name in names if ENV_PREFIX + name.upper() in environ}
        raw.update({name: value for name, value in extra.items() if value is not None})  # JSON null: unset
        if not raw.get("draft_model"):
            raise ValueError(
                "SpecExecProposer needs a draft model: set speculative_config draft_load_config="
                '{"model_loader_extra_config": {"specexec": {"draft_model": "PATH_OR_HUB_ID"}}} '
                f"or the environment variable {ENV_PREFIX}DRAFT_MODEL."
            )
        types = {f.name: f.type for f in fields(SpecExecConfig)}
        specexec = SpecExecConfig(**{k: parse_knob(k, types[k], raw[k]) for k in knobs if k in raw})
        tree = parse_knob("tree_verification", "bool", raw.get("tree_verification", False))
        prefetch = parse_knob("offload_prefetch", "int", raw.get("offload_prefetch", 1))
        offload = raw.get("offload") or None
        step_budget = raw.get("step_budget")
        auto = isinstance(step_budget, str) and step_budget.strip().lower() == AUTO
        step_budget = AUTO if auto else parse_knob("step_budget", "int", step_budget)
        if step_budget is not None and (
            not tree or not (step_budget == AUTO or isinstance(step_budget, int) and step_budget >= 1)
        ):
            raise ValueError(
                f"step_budget={step_budget!r}: a step's total of tree nodes needs tree_verification=true and an "
                f"integer of at least 1, or {AUTO!r} (chosen each step from the target's measured forward cost)."
            )
        tree_search = str(raw.get("tree_search", "specexec"))
        tree_policy(tree_search)  # an unknown name is refused here, listing the registered ones
        draft_vocab = raw.get("draft_vocab") or None
        if draft_vocab is None:
            draft_vocab = distilled_vocab_file(str(raw["draft_model"]))
        elif draft_vocab == FULL_VOCABULARY:
            draft_vocab = None
        if draft_vocab is not None and not os.path.isfile(draft_vocab):
            raise ValueError(
                f"draft_vocab={draft_vocab!r} is not a file: give a JSON file holding a list of token ids, or "
                f"{FULL_VOCABULARY!r} to score the whole vocabulary."
            )
        draft_int8 = bool(parse_knob("draft_int8", "bool", raw.get("draft_int8", False)))
        if draft_int8 and raw.get("draft_dtype") not in (None, "float32"):
            raise ValueError(
                f"draft_int8=true computes the draft's layers in int8 over float32 activations, not "
                f"draft_dtype={raw['draft_dtype']!r}: set draft_dtype to \"float32\" or leave it unset."
            )
        return cls(
            str(raw["draft_model"]), raw.get("draft_dtype"), specexec, bool(tree), offload, prefetch, step_budget,
            tree_search, draft_vocab, draft_int8,
        )


def parse_knob(name: str, annotation: str, value: Any) -> Any:
    """Turns an environment string (or JSON value) into the knob's type (``annotation``: ``"bool"``, ``"int"``,
    ``"float"`` or a tuple type's name); SpecExecConfig validates ranges."""
    if not isinstance(value, str):
        return value
    if value.strip().lower() in ("", "none"):
        return None
    try:
        if annotation == "bool":
            if value.strip().lower() not in ("true", "false", "1", "0"):
                raise ValueError(value)
            return value.strip().lower() in ("true", "1")
        if "tuple" in annotation:  # comma-separated, e.g. context_match_weights "0.1,0.5"
            return tuple(float(part) for part in value.split(",") if part.strip())
        return float(value) if "float" in annotation else int(value)
    except ValueError as error:
        raise ValueError(f"SpecExec setting {name}={value!r} is not a number, numbers or true/false.") from error


def distilled_vocab_file(draft_model: str) -> str | None:
    """The draft folder's :data:`DRAFT_VOCAB_FILE` (the tokens it was distilled to score), or ``None`` where it has
    none (a hub id, or a draft with a full head).

    Args:
        draft_model: The ``draft_model`` setting.
    """
    path = os.path.join(draft_model, DRAFT_VOCAB_FILE)
    return path if os.path.isfile(path) else None


def read_token_ids(path: str) -> torch.Tensor:
    """The token ids listed in a JSON file (a list of non-negative integers).

    Args:
        path: The file, e.g. the ``draft_vocab`` setting.
    """
    with open(path) as file:
        ids = json.load(file)
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise ValueError(f"{path} must hold a non-empty JSON list of non-negative token ids.")
    return torch.tensor(ids, dtype=torch.long)
