"""Int8 arithmetic for a Llama draft's decoder layers on a CPU.

On a CPU the draft's tree forwards (1-16 rows each) spend most of their time in float32 matrix products, and the
shipped draft's matrices are int8 with per-row scales anyway (:func:`~.drafts.quantize_rows_int8`; the load
dequantizes them). :func:`int8_draft` swaps each decoder layer for an :class:`Int8LlamaDecoderLayer` that keeps the
matrices as int8 (the query, key and value projections as one matrix, the gate and up projections as another) and
multiplies them with ``torch._int_mm`` after quantizing each activation row to int8 by its own absolute maximum;
its LM head gets int8 rows the same way (:func:`int8_head`). On this project's 2-core CPU the layers made the shipped
draft's forwards 1.3-1.5x faster at 1-32 rows and the head another 1.1-1.25x; see ``docs/drafts.md`` for the
measured effect on SpecExec.

Only the draft's proposals change (by the activations' rounding): the target verifies every token, so the output is
the target's whatever the draft computes. Why not a library: PyTorch's dynamic int8 linear
(``torch.ops.quantized.linear_dynamic``, deprecated) quantizes each activation *tensor* with one scale, and on this
draft it cut top-1 agreement with the float draft to 0.37-0.59 over 200 answer tokens; per-row scales kept 0.92.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.cache_utils import Cache
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama import modeling_llama

from .drafts import int8_row_scales, quantize_rows_int8
from .vocab import SubsetLMHead


class Int8Matrix(nn.Module):
    """``x -> x @ weight.T`` with ``weight`` held as int8 rows and their float32 scales, each row of ``x`` quantized
    to int8 by its absolute maximum, the products summed in int32.

    Args:
        weight: ``[out, in]`` float matrix.
    """

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        rows, scales = quantize_rows_int8(weight)
        self.register_buffer("rows_t", rows.t().contiguous())  # [in, out]: torch._int_mm's right operand
        self.register_buffer("scales", scales)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        x_scales = int8_row_scales(flat)
        quantized = torch.round(flat / x_scales).to(torch.int8)  # |flat / x_scales| <= 127 by the scales' definition
        product = torch._int_mm(quantized, self.rows_t).float().mul_(x_scales).mul_(self.scales)
        return product.view(*x.shape[:-1], -1)


class Int8LlamaDecoderLayer(nn.Module):
    """A :class:`~transformers.models.llama.modeling_llama.LlamaDecoderLayer`'s forward with its matrices in int8
    (:class:`Int8Matrix`); norms, rotary embedding, cache update and attention are the layer's own.

    Args:
        layer: The float layer it replaces (its norms are kept, its matrices quantized).
    """

    is_causal = True  # read by transformers' SDPA function, as from LlamaAttention

    def __init__(self, layer: modeling_llama.LlamaDecoderLayer):
        super().__init__()
        attention, mlp = layer.self_attn, layer.mlp
        self.layer_idx = attention.layer_idx
        self.head_dim = attention.head_dim
        self.scaling = attention.scaling
        self.num_key_value_groups = attention.num_key_value_groups
        self.heads = [projection.out_features // attention.head_dim for projection in
                      (attention.q_proj, attention.k_proj, attention.v_proj)]
        self.intermediate_size = mlp.gate_proj.out_features
        self.input_layernorm, self.post_attention_layernorm = layer.input_layernorm, layer.post_attention_layernorm
        self.act_fn = mlp.act_fn
        self.qkv_proj = Int8Matrix(torch.cat([attention.q_proj.weight, attention.k_proj.weight,
                                              attention.v_proj.weight]))
        self.o_proj = Int8Matrix(attention.o_proj.weight)
        self.gate_up_proj = Int8Matrix(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]))
        self.down_proj = Int8Matrix(mlp.down_proj.weight)

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs,
    ) -> torch.Tensor:
        batch, length = hidden_states.shape[:2]
        qkv = self.qkv_proj(self.input_layernorm(hidden_states)).view(batch, length, -1, self.head_dim)
        query, key, value = qkv.transpose(1, 2).split(self.heads, dim=1)
        query, key = modeling_llama.apply_rotary_pos_emb(query, key, *position_embeddings)
        if past_key_values is not None:
            key, value = past_key_values.update(key, value, self.layer_idx)
        mixed, _ = sdpa_attention_forward(self, query, key, value, attention_mask, dropout=0.0, scaling=self.scaling)
        hidden_states = hidden_states + self.o_proj(mixed.reshape(batch, length, -1))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(hidden_states)).split(self.intermediate_size, -1)
        return hidden_states + self.down_proj(self.act_fn(gate) * up)


class Int8SubsetLMHead(SubsetLMHead):
    """A :class:`~.vocab.SubsetLMHead` whose scored rows are int8 (:class:`Int8Matrix`); full-width or compact
    scores as the float head gives them.

    Args:
        head: The float subset head it replaces (its token ids are kept, its rows quantized).
    """

    def __init__(self, head: SubsetLMHead):
        nn.Module.__init__(self)  # the subset was chosen and checked when ``head`` was built
        self.out_features = head.out_features
        self.register_buffer("token_ids", head.token_ids)
        self.rows = Int8Matrix(head.weight)

    def scores(self, rows: torch.Tensor) -> torch.Tensor:
        return self.rows(rows)


class Int8LMHead(nn.Module):
    """A bias-free linear LM head over the whole vocabulary, its rows int8 (:class:`Int8Matrix`).

    Args:
        head: The float head it replaces; a head shared with the target stays the target's, the draft gets an int8
            copy (a quarter of its bytes).
    """

    def __init__(self, head: nn.Linear):
        super().__init__()
        self.out_features = head.out_features  # as nn.Linear names its output width
        self.rows = Int8Matrix(head.weight)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.rows(hidden)


def int8_head(head: nn.Module) -> nn.Module | None:
    """The int8 form of a float32 CPU LM head :func:`int8_draft` converts (a bias-free ``nn.Linear`` or a
    :class:`~.vocab.SubsetLMHead`), else ``None``: the head stays as it is."""
    weight = getattr(head, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.device.type != "cpu" or weight.dtype != torch.float32:
        return None
    if type(head) is SubsetLMHead:
        return Int8SubsetLMHead(head)
    if type(head) is nn.Linear and head.bias is None:
        return Int8LMHead(head)
    return None


def int8_refusal(draft: PreTrainedModel) -> str | None:
    """Why :func:`int8_draft` cannot convert ``draft`` (``None``: it can)."""
    if type(draft) is not modeling_llama.LlamaForCausalLM:
        return f"it converts Llama drafts (LlamaForCausalLM), not {type(draft).__name__}"
    if draft.config._attn_implementation != "sdpa":
        return f"it needs SDPA attention, the draft uses {draft.config._attn_implementation!r}"
    if draft.config.attention_bias or draft.config.mlp_bias:
        return "it converts projections without biases, the draft's have biases"
    for layer in draft.model.layers:
        if type(layer) is Int8LlamaDecoderLayer:
            continue
        if type(layer) is not modeling_llama.LlamaDecoderLayer:
            return f"it converts LlamaDecoderLayer, the draft has {type(layer).__name__}"
        weight = layer.self_attn.q_proj.weight
        if weight.device.type != "cpu" or weight.dtype != torch.float32:
            return f"int8 products run on the CPU in float32, the draft's layers are {weight.dtype} on {weight.device}"
    return None


def int8_draft(draft: PreTrainedModel) -> PreTrainedModel:
    """Swaps ``draft``'s decoder layers for :class:`Int8LlamaDecoderLayer` and its LM head for an int8 one
    (:func:`int8_head`; another kind of head stays float) in place, what is already int8 staying; returns ``draft``.
    Its float matrices are dropped, so the draft holds a quarter of their bytes (a head shared with the target stays
    the target's, and the draft holds an int8 copy).

    Raises:
        ValueError: The draft is not a float32 Llama on the CPU with SDPA attention and bias-free projections; the
            message says which.
    """
    refusal = int8_refusal(draft)
    if refusal:
        raise ValueError(f"int8_draft: {refusal}. Keep the draft as it is (its proposals need no int8).")
    with torch.no_grad():
        draft.model.layers = nn.ModuleList(
            layer if type(layer) is Int8LlamaDecoderLayer else Int8LlamaDecoderLayer(layer)
            for layer in draft.model.layers
        )
        head = int8_head(draft.get_output_embeddings())
        if head is not None:
            draft.set_output_embeddings(head)
    return draft.eval()
