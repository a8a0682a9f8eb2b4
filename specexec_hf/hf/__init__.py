"""The transformers adapter: SpecExec inside ``generate()``.

- :mod:`.generation`: the ``custom_generate`` adapter: checks, then the decoder's steps, committed and recorded;
  :mod:`.batch`: a batch of prompts, every row's tree verified in one target forward per step;
- :mod:`.decoder`: one SpecExec step (``SpecExecDecoder.step``: one tree, one target forward, one walk) and the
  target's choice rule; :mod:`.outputs`: the scores, logits, hidden states and statistics ``generate()`` returns;
- :mod:`.tree_scorer`: a model scoring trees after the committed tokens with its KV cache kept (the target's
  verification, an intermediate draft's); :mod:`.intermediate_draft`: the intermediate of a draft hierarchy
  (``intermediate_model``, TriForce);
- :mod:`.candidate_generator`: the draft side (``SpecExecCandidateGenerator``, a transformers ``CandidateGenerator``):
  tree ranking and learning; :func:`grow_trees` grows several requests' trees with batched draft forwards, whatever
  the tree policy;
- :mod:`.draft_cache`: the draft's KV cache kept across steps, and the feeds that grow a tree into it;
  :mod:`.draft_graphs`: the draft over a preallocated cache and padded feeds, replayed as CUDA graphs on a GPU;
- :mod:`.forward`: the forward path: one ``Feed`` record for draft and target, one builder of a forward's inputs
  (one sequence, or several packed over a batched cache), logits, the lazy LM head;
- :mod:`.compat`: what a model must support, checked up front (checks, probes, vocabulary and tokenizer, execution
  device); :mod:`.settings`: SpecExec's settings carried by a ``GenerationConfig``;
- :mod:`.kv`: KV-cache compaction after each step; :mod:`.autobudget`: ``budget="auto"``;
- :mod:`.calibrated`: a draft's calibrated ranking settings; :mod:`.learnt_state`: what decoding learns (acceptance
  maps, ``budget="auto"``'s estimates), carried by the draft or passed as ``learnt_state=``; :mod:`.cache_dir`: the
  on-disk cache;
- :mod:`.self_draft`: drafts passed by name (``"self:int4"``, ``"self:exit:K"``, ...), resolved by the resolver
  ``specexec_hf.models.self_draft`` registers (the drafts are built there);
- :mod:`.executor`: the typed seam to the executors that stream a target's weights (``specexec_hf.offload``):
  what this layer may ask them, and how a model's executor is attached and found;
- :mod:`.ownership`: a model used by one call at a time where its executor requires it (a streamed target's ring),
  held by ``generate()`` for the whole call.
"""

from .candidate_generator import SpecExecCandidateGenerator, TreeBatch, grow_trees
from .compat import UnsupportedModelError
from .decoder import SpecExecDecoder, StepOutcome, TreeLogitsProcessor
from .generation import generate
from .learnt_state import LearntState
from .outputs import SpecExecDecoderOnlyOutput

__all__ = [
    "LearntState",
    "SpecExecCandidateGenerator",
    "SpecExecDecoder",
    "SpecExecDecoderOnlyOutput",
    "StepOutcome",
    "TreeBatch",
    "TreeLogitsProcessor",
    "UnsupportedModelError",
    "generate",
    "grow_trees",
]
