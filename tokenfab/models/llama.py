"""The Llama family: Llama 2/3, Mistral, Qwen2 (qkv bias), Qwen3 (q/k RMSNorm), SmolLM.

    h = x + Attn(RMSNorm(x));   out = h + MLP(RMSNorm(h))
    Attn: q, k, v = x Wqkv (+b); q, k = RoPE(q, k) (after per-head RMSNorm in Qwen3);
          o = softmax(q k^T / sqrt(d)) v over the paged cache; out = o Wo
    MLP:  down(silu(gate(x)) * up(x))

Tensor parallel (TP > 1, ``distributed.parallel_state``): heads split over the ranks (qkv
column-parallel by head, o row-parallel), gate/up column- and down row-parallel, one all-reduce
after attention and one after the MLP (inside the row-parallel layers), vocabulary-parallel
embedding and LM head (every rank ends with the full logits). At TP 1 the same classes hold the
whole weights and issue no collective.

Submodules are called through ``.forward``: ``nn.Module.__call__`` (hook machinery the engine never
uses) costs ~1 us a call, ~0.3-0.5 ms a token over the ~330 module calls of a decode step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from tokenfab.distributed import two_batch
from tokenfab.forward_batch import ForwardBatch
from tokenfab.kernels import silu_and_mul
from tokenfab.layers.attention import Attention
from tokenfab.layers.embedding import LMHead, VocabEmbedding
from tokenfab.layers.linear import Linear, MergedLinear, qkv_linear
from tokenfab.layers.norm import RMSNorm
from tokenfab.layers.rotary import RotaryEmbedding, rope_parameters
from tokenfab.models.llama_native import native_hidden


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def layer_sliding_window(config: Any, layer_idx: int) -> int:
    """The sliding window of a layer, 0 for full attention."""
    window = getattr(config, "sliding_window", None) or 0
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_idx] == "sliding_attention" else 0
    if getattr(config, "use_sliding_window", None) is False:
        return 0
    return window


class LlamaAttention(nn.Module):
    """At TP > 1 the query heads are split over the ranks (the KV heads too, or replicated when TP
    exceeds them): qkv_proj is column-parallel by head, o_proj row-parallel (its all-reduce is the
    one after attention); ``num_heads`` / ``num_kv_heads`` are this rank's."""

    def __init__(self, config: Any, layer_idx: int, max_position: int) -> None:
        super().__init__()
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        self.head_dim = head_dim_of(config)
        model_type = getattr(config, "model_type", "llama")
        qkv_bias = model_type == "qwen2" or bool(getattr(config, "attention_bias", False))
        o_bias = model_type != "qwen2" and bool(getattr(config, "attention_bias", False))
        self.qkv_proj = qkv_linear(config.hidden_size, self.head_dim, num_heads, num_kv_heads, bias=qkv_bias)
        self.o_proj = Linear(num_heads * self.head_dim, config.hidden_size, bias=o_bias, parallel="row")
        q_size, kv_size, _ = self.qkv_proj.shard_sizes  # this rank's
        self.num_heads, self.num_kv_heads = q_size // self.head_dim, kv_size // self.head_dim
        self.qk_norm = model_type == "qwen3"
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(
            self.head_dim, max_position, rope_parameters(config), config.max_position_embeddings
        )
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
            sliding_window=layer_sliding_window(config, layer_idx),
        )
        self.splits = [q_size, kv_size, kv_size]

    @property
    def ends_in_all_reduce(self) -> bool:  # two-batch overlap: o_proj's all-reduce is the last op
        return getattr(self.o_proj, "reduce_output", False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        q, k, v = self.qkv_proj.forward(x).split(self.splits, dim=-1)
        q = q.view(t, self.num_heads, self.head_dim)
        k = k.view(t, self.num_kv_heads, self.head_dim)
        v = v.view(t, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm.forward(q), self.k_norm.forward(k)
        q, k = self.rotary_emb.forward(batch.positions, q, k)
        o = self.attn.forward(q, k, v, batch)
        return self.o_proj.forward(o.reshape(t, -1))


class LlamaMLP(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        inter, bias = config.intermediate_size, bool(getattr(config, "mlp_bias", False))
        self.gate_up_proj = MergedLinear(config.hidden_size, [inter, inter], bias=bias, parallel="column")
        self.down_proj = Linear(inter, config.hidden_size, bias=bias, parallel="row")  # all-reduce after the MLP

    @property
    def ends_in_all_reduce(self) -> bool:  # two-batch overlap: down_proj's all-reduce is the last op
        return getattr(self.down_proj, "reduce_output", False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj.forward(silu_and_mul(self.gate_up_proj.forward(x)))


class DecoderLayer(nn.Module):
    """Pre-norm residual block: h = x + attn(norm(x)); out = h + mlp(norm(h)). Every model family
    builds its layers from this with its own attention and MLP (dense or MoE)."""

    def __init__(self, config: Any, self_attn: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = self_attn
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = mlp

    def _attn_input(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual); the first layer's residual is x itself."""
        if residual is None:
            residual = x.clone()
            return self.input_layernorm.forward(x), residual
        return self.input_layernorm.forward(x, residual)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch
    ) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self._attn_input(x, residual)
        h, residual = self.post_attention_layernorm.forward(self.self_attn.forward(h, batch), residual)
        return self.mlp.forward(h), residual

    def forward_stages(self, x: torch.Tensor, residual: torch.Tensor | None, batch: ForwardBatch) -> two_batch.Stages:
        """``forward`` as stages (distributed/two_batch.py): the same pieces, each module call through
        ``yield from two_batch.call``, which in an overlapped step ends a stage after the call's
        collective is launched (attention, MLP/MoE). ``forward`` stays generator-free: torch.compile
        (fullgraph) does not trace generators' return values."""
        h, residual = self._attn_input(x, residual)
        h = yield from two_batch.call(self.self_attn, h, batch)
        h, residual = self.post_attention_layernorm.forward(h, residual)
        return (yield from two_batch.call(self.mlp, h)), residual


class DecoderModel(nn.Module):
    def __init__(self, config: Any, make_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(make_layer(i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        if two_batch.wanted(batch) and two_batch.model_allows(self):  # --enable-two-batch-overlap, TP/EP > 1
            return two_batch.forward(self, batch)
        x, residual = self.embed_tokens.forward(batch.input_ids), None
        for layer in self.layers:
            x, residual = layer.forward(x, residual, batch)
        x, _ = self.norm.forward(x, residual)
        return x

    def forward_stages(self, batch: ForwardBatch) -> two_batch.Stages:
        """``forward``'s layer loop as stages (a micro-batch of an overlapped step)."""
        x, residual = self.embed_tokens.forward(batch.input_ids), None
        for layer in self.layers:
            x, residual = yield from two_batch.call(layer, x, residual, batch)
        x, _ = self.norm.forward(x, residual)
        return x


class CausalLM(nn.Module):
    """Embeddings, decoder layers from ``make_layer(i)``, final norm, LM head (tied if the config says)."""

    # checkpoint projection name -> (our merged module, shard index)
    packed_modules = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: Any, make_layer: Callable[[int], nn.Module]) -> None:
        super().__init__()
        self.config = config
        self.model = DecoderModel(config, make_layer)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, H] of every token of the batch."""
        return self.model(batch)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(hidden)


class LlamaForCausalLM(CausalLM):
    def __init__(self, config: Any, max_position: int | None = None) -> None:
        max_position = max_position or config.max_position_embeddings
        super().__init__(
            config, lambda i: DecoderLayer(config, LlamaAttention(config, i, max_position), LlamaMLP(config))
        )

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, H]; with packed GGML weights on CPU, the whole step in one C call
        (``llama_native``: the same kernels, the same bits) where the model allows it."""
        hidden = native_hidden(self, batch)
        return hidden if hidden is not None else self.model(batch)
