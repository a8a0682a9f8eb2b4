"""vLLM verifies a whole SpecExec tree in one target forward, in place of its chain verification.

vLLM (0.32) verifies chains: draft token ``i`` sits at position ``root + i`` and sees every draft token before
it. The tree verifier turns the draft rows of requests that carry a SpecExec tree into tree rows:

1. positions: each tree row gets ``root position + depth`` (its KV slot stays the sequential one vLLM
   allocated, so the scheduler's slot bookkeeping is untouched);
2. attention: the native kernel runs the whole batch and writes every row's KV; then the tree rows' outputs
   are recomputed with ``scaled_dot_product_attention`` over each request's KV gathered through the block table
   (:mod:`.tree_attention`), under a ``[prefix | ancestor]`` mask, all tree requests of the batch padded into one
   call per layer (prefill chunks and chain requests in the same batch keep the native result);
3. acceptance: the target's own choice at each node (its argmax, or a draw from its processed distribution with the
   request's generator, :func:`node_choices`) is walked down the tree
   (:func:`~specexec_hf.core.verify.acceptance_walk`) in place of the rejection sampler, and the accepted
   tokens plus the bonus token are emitted in the ``-1``-padded layout vLLM's bookkeeping reads, so the
   scheduler rolls ``num_computed_tokens`` back by the rejected count as it does for chains;
4. KV compaction: before the step ends, every layer's KV of the accepted nodes is read back from the slots the
   native kernel wrote and rewritten into the slots right after the root (through the backend's own
   ``do_kv_cache_update``), which is where the next step, and the prefix cache, expect the committed tokens.

The model runner hands the verifier its steps through the proposer's runner seams (``_prepare_inputs`` and
``_sample``, :mod:`.proposer`); the attention layers reach it through the CPU attention backend's seam, which
:func:`apply` puts in place (:data:`~.seams.CPU_ATTENTION_FORWARD`). Only requests without history-dependent logit
processing get trees (the proposer decides, see :func:`request_takes_tree`); every other request in the batch is
sampled by vLLM's own sampler. Engines the verifier does not cover are refused at start: see :func:`check_engine`.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch

from ..core.tree import TokenTree
from ..core.verify import acceptance_walk
from ..patches.patch import Patch
from .seams import CPU_ATTENTION_FORWARD
from .tree_attention import (
    PaddedTreeRows,
    gather_paged_kv,
    pad_tree_rows,
    probe_kv_layout,
    read_paged_kv,
    split_kv_cache,
    tree_attention,
    tree_rows_mask,
)

PLACEHOLDER_TOKEN_ID = -1  # what vLLM's rejection sampler writes after a request's last accepted token
# What refusals name: the feature, and how to do without it.
TREE_VERIFICATION = "SpecExec tree verification"
WITHOUT_TREES = "set tree_verification=false to verify the tree's best chain with vLLM's own rejection sampler"


def request_takes_tree(sampling_params: Any) -> bool:
    """Whether the tree walk reproduces the request's next-token choice exactly: greedy, or sampled from the target's
    logits under temperature, min-p, top-k and top-p only (:func:`node_choices` applies them at every node).

    Penalties, bad words and ``min_tokens`` depend on the tokens before each node, and logit bias, allowed tokens,
    logprobs and structured output change or read the processed logits; such requests are verified without a
    tree (vLLM samples them itself).

    Args:
        sampling_params: The request's ``vllm.SamplingParams``.
    """
    p = sampling_params
    return (
        p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and p.repetition_penalty == 1.0
        and not p.bad_words
        and p.min_tokens == 0
        and not p.logit_bias
        and not p.allowed_token_ids
        and p.logprobs is None
        and p.structured_outputs is None
    )


@dataclass(frozen=True)
class NodeSampling:
    """How a sampled request turns the target's logits at a node into its next token, as vLLM's sampler does.

    Args:
        temperature: Above vLLM's greedy threshold (``1e-5``).
        top_k: Tokens kept; 0 or the vocabulary size keeps all.
        top_p: Nucleus mass kept; 1 keeps all.
        min_p: Tokens below ``min_p`` times the top probability are dropped; 0 keeps all.
        generator: The request's own generator (a seeded request), else ``None`` for torch's default one.
    """

    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    generator: torch.Generator | None = None


GREEDY_EPSILON = 1e-5  # vLLM's _SAMPLING_EPS: temperatures below it are greedy


def node_sampling(sampling_params: Any, generator: torch.Generator | None) -> NodeSampling | None:
    """The request's :class:`NodeSampling`, or ``None`` for a greedy request.

    Args:
        sampling_params: The request's ``vllm.SamplingParams``.
        generator: Its generator (``CachedRequestState.generator``), ``None`` unless it was given a seed.
    """
    p = sampling_params
    if p.temperature < GREEDY_EPSILON:
        return None
    return NodeSampling(float(p.temperature), int(p.top_k), float(p.top_p), float(p.min_p), generator)


def node_choices(logits: torch.Tensor, sampling: NodeSampling | None) -> torch.Tensor:
    """The target's own choice at every node: ``[nodes]`` tokens from ``[nodes, vocab]`` logits.

    Greedy: the argmax. Sampled: one independent draw per node from the distribution vLLM's sampler draws from
    (temperature, then min-p, then vLLM's own top-k/top-p masking, in its order); the walk reads the draws of the
    nodes it visits only, so every emitted token is a draw from the target's distribution given the tokens before.
    """
    if sampling is None:
        return logits.argmax(dim=-1)
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

    logits = logits.float() / sampling.temperature
    if sampling.min_p > 0:
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < sampling.min_p * probs.amax(dim=-1, keepdim=True), -float("inf"))
    rows, vocab = logits.shape
    top_k = sampling.top_k if 0 < sampling.top_k < vocab else None
    top_p = sampling.top_p if sampling.top_p < 1.0 else None
    if top_k is not None or top_p is not None:
        logits = apply_top_k_top_p(
            logits,
            None if top_k is None else torch.full((rows,), top_k, dtype=torch.long, device=logits.device),
            None if top_p is None else torch.full((rows,), top_p, dtype=torch.float32, device=logits.device),
        )
    probs = logits.softmax(dim=-1)
    # Exponential race (argmax of p / E, E ~ Exp(1)) picks token i with probability p_i, without a host sync.
    noise = torch.empty_like(probs).exponential_(generator=sampling.generator)
    return (probs / noise).argmax(dim=-1)


def chain_tree(tokens: list[int]) -> TokenTree:
    """The draft tokens ``tokens`` as a chain under a root (whose token the walk never reads)."""
    count = len(tokens)
    return TokenTree(
        tokens=torch.tensor([-1, *tokens]),
        parents=torch.arange(-1, count),
        depths=torch.arange(count + 1),
        logprobs=torch.zeros(count + 1),
    )


@dataclass
class StepTree:
    """One request's tree in the current forward.

    Args:
        req_id: vLLM request id.
        row: The request's row in the input batch.
        start: Its first token's row in the flattened batch (the root).
        prefix_length: Committed tokens before the root (the root's position).
        tree: The verified tree (truncated to what the scheduler scheduled).
        visible: ``[N - 1, prefix_length + N]`` what each non-root node attends to.
        proposed: Whether it is the proposer's tree (else a draft list verified as a chain).
    """

    req_id: str
    row: int
    start: int
    prefix_length: int
    tree: TokenTree
    visible: torch.Tensor
    proposed: bool


@dataclass
class LayerRows:
    """One attention layer of this step: what compaction needs to move its KV (read back from its cache)."""

    impl: Any
    layer: Any
    kv_cache: torch.Tensor


@dataclass
class TreeStats:
    """Running totals (readable with ``LLM.collective_rpc``); the node counts cover proposed trees only.

    Args:
        steps: Forwards that verified at least one tree or chain.
        trees: Proposed trees verified.
        sampled_trees: Those of sampled requests (the rest are greedy).
        tree_nodes: Their draft nodes (roots excluded).
        accepted_nodes: Their accepted draft nodes.
        moved_nodes: Accepted nodes whose KV had to move (a path through a non-first sibling).
        chains: Draft lists verified as chains because they were not the proposed tree's (vLLM's zeros).
        max_accepted: Longest accepted path of a tree in one step.
    """

    steps: int = 0
    trees: int = 0
    sampled_trees: int = 0
    tree_nodes: int = 0
    accepted_nodes: int = 0
    moved_nodes: int = 0
    chains: int = 0
    max_accepted: int = 0


@dataclass
class TreeVerifier:
    """Tree verification on one engine: proposed trees by request id, and the step in flight.

    The proposer's runner seams call :meth:`place_tree_rows` after vLLM prepares a step's inputs and :meth:`sample` in
    place of vLLM's sampling whenever :attr:`in_flight`; the attention seam calls :meth:`attend` for every layer.
    """

    proposed: dict[str, TokenTree] = field(default_factory=dict)
    step: list[StepTree] = field(default_factory=list)
    layers: dict[int, LayerRows] = field(default_factory=dict)
    padded: PaddedTreeRows | None = None  # the step's tree rows as one batch, built by its first attention layer
    stats: TreeStats = field(default_factory=TreeStats)
    slot_mapping: torch.Tensor | None = None

    def propose(self, req_id: str, tree: TokenTree | None) -> None:
        """Records (``None``: forgets) the tree whose non-root tokens the proposer just returned for ``req_id``."""
        if tree is None:
            self.proposed.pop(req_id, None)
        else:
            self.proposed[req_id] = tree

    @property
    def in_flight(self) -> bool:
        """Whether the step being computed verifies trees (or draft lists as chains)."""
        return bool(self.step)

    def place_tree_rows(self, runner: Any, scheduler_output: Any, num_scheduled_tokens: np.ndarray) -> None:
        """Tree positions for the scheduled trees, once vLLM's ``_prepare_inputs`` has run; arms the attention seam.

        Args:
            runner: The V1 model runner.
            scheduler_output: The step's ``SchedulerOutput``.
            num_scheduled_tokens: ``[rows]`` tokens scheduled per row of the input batch.
        """
        self.step, self.layers, self.padded = [], {}, None
        for req_id, drafts in scheduler_output.scheduled_spec_decode_tokens.items():
            tree = self.proposed.pop(req_id, None)
            if not drafts:
                continue
            count = len(drafts) + 1  # the scheduler may keep only a prefix: still a tree (parents come first)
            proposed = tree is not None and count <= tree.num_nodes and tree.tokens[1:count].tolist() == list(drafts)
            # Anything else is verified exactly as a chain: near max_model_len vLLM replaces every proposal with
            # zeros (GPUModelRunner._input_fits_in_drafter).
            tree = tree.select(torch.arange(count)) if proposed else chain_tree(list(drafts))
            row = runner.input_batch.req_id_to_index[req_id]
            if int(num_scheduled_tokens[row]) != count:
                raise RuntimeError(f"Request {req_id}: its tree was scheduled in pieces; tree rows cannot be split.")
            start = int(runner.query_start_loc.np[row])
            prefix = int(runner.input_batch.num_computed_tokens_cpu[row])
            depths = tree.depths.to(runner.positions.device)
            runner.positions[start : start + count] = prefix + depths
            visible = tree_rows_mask(tree.ancestor_mask(), prefix)
            self.step.append(StepTree(req_id, row, start, prefix, tree, visible, proposed))
        # A request the scheduler skips this step keeps its draft tokens for a later step, so its tree stays too;
        # finished requests have left runner.requests by now.
        self.proposed = {req_id: tree for req_id, tree in self.proposed.items() if req_id in runner.requests}
        _ACTIVE.verifier = self if self.step else None

    def attend(
        self, impl: Any, layer: Any, query: torch.Tensor, kv_cache: torch.Tensor, metadata: Any, output: torch.Tensor
    ) -> None:
        """Recomputes the tree rows of one layer's attention output, all requests in one padded batch; the KV the
        native kernel wrote for them stays in the cache for compaction."""
        key_cache, value_cache = split_kv_cache(kv_cache)
        block_size = key_cache.shape[2]
        if self.padded is None:  # the block table and the rows are the same in every layer of the step
            self.slot_mapping = metadata.slot_mapping  # one KV cache group (hybrid groups are refused)
            rows = torch.tensor([item.row for item in self.step], device=metadata.block_table.device)
            self.padded = pad_tree_rows(
                [item.start for item in self.step], [item.visible for item in self.step],
                metadata.block_table[rows], block_size,
            )  # fmt: skip
        padded = self.padded
        keys, values = gather_paged_kv(key_cache, value_cache, padded.blocks, padded.length)
        if padded.beyond is not None:
            keys, values = keys.masked_fill(padded.beyond, 0), values.masked_fill(padded.beyond, 0)
        attended = tree_attention(query[padded.query_rows], keys, values, padded.visible, impl.scale)
        attended = attended.flatten(0, 1)[padded.kept]
        output[padded.output_rows] = attended.reshape(-1, *output.shape[1:]).to(output.dtype)
        self.layers[id(layer)] = LayerRows(impl, layer, kv_cache)

    def sample(self, runner: Any, logits: torch.Tensor, metadata: Any) -> Any:
        """In place of vLLM's ``_sample`` while :attr:`in_flight`: root tokens, tree walks and KV compaction.

        Args:
            runner: The V1 model runner.
            logits: ``[rows, vocab]`` the target's logits of the step's sampled rows.
            metadata: The step's ``SpecDecodeMetadata``.
        """
        _ACTIVE.verifier = None
        from vllm.v1.spec_decode.metadata import SpecDecodeMetadata

        step, self.step = self.step, []
        num_drafts = np.asarray(metadata.num_draft_tokens)
        starts = np.concatenate([[0], np.cumsum(num_drafts + 1)[:-1]])  # each request's first logits row
        trees = {item.row: item for item in step}
        if any(n > 0 and row not in trees for row, n in enumerate(num_drafts)):
            raise RuntimeError("A batch mixes SpecExec trees with chain drafts; tree verification needs trees only.")
        device = logits.device
        roots = torch.as_tensor(starts, dtype=torch.long, device=device)
        batch = len(num_drafts)
        int32 = {"dtype": torch.int32, "device": device}
        # vLLM's own sampler picks every request's token at its root row (chains of zero drafts): prefill chunks
        # and non-tree requests are sampled exactly as without speculation, generators and logprobs included. The
        # draft tokens are hidden from it, or its penalties would expect one logits row per draft token.
        at_roots = SpecDecodeMetadata(
            draft_token_ids=torch.empty(0, **int32),
            num_draft_tokens=[0] * batch,
            cu_num_draft_tokens=torch.zeros(batch, **int32),
            cu_num_sampled_tokens=torch.arange(1, batch + 1, **int32),
            target_logits_indices=torch.empty(0, **int32),
            bonus_logits_indices=torch.arange(batch, **int32),
            logits_indices=metadata.logits_indices[roots],
        )
        sampling = runner.input_batch.sampling_metadata
        without_drafts = replace(sampling, spec_token_ids=[[] for _ in range(batch)])
        output = runner.rejection_sampler(at_roots, None, logits[roots], without_drafts)
        root_tokens = output.sampled_token_ids[:, 0].tolist()
        paths: dict[int, list[int]] = {}
        emitted: dict[int, list[int]] = {}
        for row, item in trees.items():
            state = runner.requests[item.req_id]
            sampling = node_sampling(state.sampling_params, state.generator)
            self.stats.sampled_trees += int(sampling is not None and item.proposed)
            choices = node_choices(logits[starts[row] + 1 : starts[row] + item.tree.num_nodes], sampling).tolist()
            choices.insert(0, root_tokens[row])
            walk = acceptance_walk(item.tree, choices.__getitem__)
            paths[row], emitted[row] = walk.path, walk.tokens
        width = max(len(tokens) for tokens in emitted.values())
        sampled = torch.full((batch, width), PLACEHOLDER_TOKEN_ID, dtype=output.sampled_token_ids.dtype, device=device)
        sampled[:, 0] = output.sampled_token_ids[:, 0]
        for row, tokens in emitted.items():
            sampled[row, : len(tokens)] = torch.tensor(tokens, dtype=sampled.dtype, device=device)
        self._compact(step, paths)
        self._count(step, paths)
        logprobs = output.logprobs_tensors
        if logprobs is not None:  # one row per emitted slot; tree requests never ask for logprobs
            repeat = torch.arange(batch, device=device).repeat_interleave(width)
            logprobs = type(logprobs)(*(tensor[repeat] for tensor in logprobs[:3]))
        return type(output)(sampled_token_ids=sampled, logprobs_tensors=logprobs)

    def _compact(self, step: list[StepTree], paths: dict[int, list[int]]) -> None:
        """Rewrites the accepted nodes' KV into the slots right after each root, in every layer."""
        sources, destinations = [], []
        for item in step:
            path = paths[item.row]
            if path != list(range(1, len(path) + 1)):
                sources.append(item.start + torch.tensor(path))
                destinations.append(item.start + 1 + torch.arange(len(path)))
        layers, self.layers = self.layers, {}
        if not sources:
            return
        source_slots = self.slot_mapping[torch.cat(sources).to(self.slot_mapping.device)].long()
        destination = self.slot_mapping[torch.cat(destinations).to(self.slot_mapping.device)]
        for rows in layers.values():
            key_cache, value_cache = split_kv_cache(rows.kv_cache)
            # Every source is read before any slot is written (a destination can be another node's source).
            keys, values = read_paged_kv(key_cache, value_cache, source_slots)
            rows.impl.do_kv_cache_update(rows.layer, keys, values, rows.kv_cache, destination)

    def _count(self, step: list[StepTree], paths: dict[int, list[int]]) -> None:
        stats = self.stats
        stats.steps += 1
        for item in step:
            path = paths[item.row]
            if not item.proposed:
                stats.chains += 1
                continue
            stats.trees += 1
            stats.tree_nodes += item.tree.num_nodes - 1
            stats.accepted_nodes += len(path)
            stats.moved_nodes += sum(node != depth for depth, node in enumerate(path, start=1))
            stats.max_accepted = max(stats.max_accepted, len(path))


class _Active(threading.local):
    """The verifier whose forward is running (attention layers have no handle on the runner)."""

    verifier: TreeVerifier | None = None


_ACTIVE = _Active()


def _tree_aware(forward: Callable[..., Any]) -> Callable[..., Any]:
    """The CPU attention backend's ``forward``, then the tree rows' attention of the verifier in flight."""

    def tree_aware_forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs):
        result = forward(self, layer, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs)
        verifier = _ACTIVE.verifier
        if verifier is not None and attn_metadata is not None:
            verifier.attend(self, layer, query, kv_cache, attn_metadata, output)
        return result

    return tree_aware_forward


_ATTENTION: list[Patch] = []  # the attention seam, built on first use (vLLM is imported then)


def _attention_patch() -> Patch:
    if not _ATTENTION:
        _ATTENTION.append(CPU_ATTENTION_FORWARD.patch(_tree_aware, TREE_VERIFICATION, WITHOUT_TREES))
    return _ATTENTION[0]


def apply() -> None:
    """Puts the attention seam in place (idempotent): attention layers compute the tree rows of a verifier in flight,
    and are vLLM's own otherwise."""
    _attention_patch().apply()


def revert() -> None:
    """Gives the CPU attention backend its own ``forward`` back (nothing if not applied)."""
    if _ATTENTION:
        _ATTENTION[0].revert()
    _ACTIVE.verifier = None


def check_engine(vllm_config: Any, device: Any) -> None:
    """Raises ``ValueError`` for engines tree verification does not cover, naming the setting to change.

    Args:
        vllm_config: The engine's ``VllmConfig``.
        device: The engine's ``torch.device``.
    """
    config = vllm_config
    refusals = [
        (device.type != "cpu", "devices other than the CPU attention backend (GPUs: tree_verification=false)"),
        (bool(config.scheduler_config.async_scheduling), "async scheduling: pass async_scheduling=False"),
        (config.parallel_config.pipeline_parallel_size > 1, "pipeline parallelism: use pipeline_parallel_size=1"),
        (config.parallel_config.tensor_parallel_size > 1, "tensor parallelism is not covered: tensor_parallel_size=1"),
        (bool(config.model_config.uses_mrope), "M-RoPE models (positions are not one index per token)"),
        (bool(config.model_config.is_hybrid), "hybrid models (recurrent state cannot follow a tree)"),
        (bool(config.model_config.logits_processors), "custom logits processors (the walk reads raw argmaxes)"),
        (config.cache_config.cache_dtype not in ("auto", None), "quantized KV caches: use kv_cache_dtype='auto'"),
    ]
    reasons = [reason for refused, reason in refusals if refused]
    if reasons:
        raise ValueError(f"{TREE_VERIFICATION} does not support " + "; ".join(reasons) + ".")


def check_attention_layers(vllm_config: Any) -> None:
    """Raises ``ValueError`` unless every attention layer of the loaded target is plain causal CPU attention whose
    KV layout :mod:`.tree_attention` reads (probed once per dtype and head size).

    Args:
        vllm_config: The engine's ``VllmConfig``, its target built (its attention layers registered).
    """
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl, _get_attn_isa

    block_size = vllm_config.cache_config.block_size
    probed = set()
    for name, module in vllm_config.compilation_config.static_forward_context.items():
        impl = getattr(module, "impl", None)
        if impl is None:
            continue
        if not isinstance(impl, CPUAttentionBackendImpl):
            raise TypeError(f"{TREE_VERIFICATION} needs the CPU attention backend; layer {name} uses {impl}.")
        special = {
            "sliding window": impl.sliding_window != -1,
            "logit soft-capping": bool(impl.logits_soft_cap),
            "ALiBi": impl.alibi_slopes is not None,
            "attention sinks": impl.sinks is not None,
            "non-decoder attention": str(impl.attn_type).split(".")[-1].lower() != "decoder",
            "KV sharing": impl.kv_sharing_target_layer_name is not None,
        }
        found = [what for what, present in special.items() if present]
        if found:
            raise ValueError(f"{TREE_VERIFICATION} does not support {', '.join(found)} (layer {name}).")
        key = (vllm_config.model_config.dtype, impl.head_size)
        if key not in probed:
            probed.add(key)
            dtype, head_size = key
            probe_kv_layout(_get_attn_isa(dtype, block_size, head_size), dtype, block_size, head_size)


def start(vllm_config: Any, device: Any) -> TreeVerifier:
    """A verifier for an engine whose target is loaded, after refusing what it does not cover; puts the attention
    seam in place.

    Args:
        vllm_config: The engine's ``VllmConfig``.
        device: The engine's ``torch.device``.
    """
    check_engine(vllm_config, device)
    check_attention_layers(vllm_config)
    apply()
    return TreeVerifier()
