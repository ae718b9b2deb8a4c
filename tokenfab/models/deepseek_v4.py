"""DeepSeek-V4 (V4-Flash, V4-Pro): compressed attention, hyper-connections, hash-routed and sqrtsoftplus MoE.

    h = [e, e, ..., e]                                      hc_mult residual streams [T, n, D] (mHC)
    per layer:  x, post, comb = mHC_attn(h);  h = post * Attn(RMSNorm(x)) + comb^T h
                x, post, comb = mHC_ffn(h);   h = post * MoE(RMSNorm(x), ids) + comb^T h
    logits = W_head RMSNorm(HyperHead(h))

    Attn: ``layer_types`` sliding_attention | compressed_sparse_attention (CSA, ratio 4, lightning
          indexer top-k) | heavily_compressed_attention (HCA, ratio 128): ``tokenfab/layers/dsv4_attention.py``.
    MoE:  scores s = sqrt(softplus(x Wr^T)); "moe" layers pick the top-k of s + correction bias,
          "hash_moe" layers take the experts of a fixed token-id table (``tid2eid``); weights s of the picks,
          renormalized, times routed_scaling_factor; experts and the shared expert are SwiGLU with the
          gate clamped at ``swiglu_limit`` from above and the up projection to [-limit, limit].

Checkpoint names (DeepSeek's own layout, which transformers' ``save_pretrained`` writes): ``embed.weight``
(or ``model.embed_tokens.weight``), ``layers.{i}.{attn,ffn,attn_norm,ffn_norm,hc_attn_*,hc_ffn_*}``,
``ffn.gate.{weight,bias,tid2eid}``, ``ffn.experts.{e}.{w1,w2,w3}``, ``ffn.shared_experts.{w1,w2,w3}``,
``norm``, ``head``, ``hc_head_{fn,base,scale}``, an optional ``model.`` prefix. The MTP layers (``mtp.*``)
are kept aside in ``mtp_weights``: the speculative proposer builds its layer from them
(``tokenfab/speculative/dsv4_mtp.py``), fed the streams of ``forward_streams``.
"""

from __future__ import annotations

import re
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenfab.forward_batch import ForwardBatch
from tokenfab.layers.dsv4_attention import DeepseekV4Attention
from tokenfab.layers.embedding import LMHead, VocabEmbedding
from tokenfab.layers.hyper_connections import HyperConnection, HyperHead, hc_expand
from tokenfab.layers.linear import Linear
from tokenfab.layers.moe import FusedMoE
from tokenfab.layers.moe_loading import load_expert_checkpoint_tensor
from tokenfab.layers.norm import RMSNorm


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


class ClampedMLP(nn.Module):
    """The shared expert: w2(silu(clamp(w1 x)) * clamp(w3 x))."""

    def __init__(self, hidden_size: int, intermediate_size: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = Linear(hidden_size, intermediate_size)
        self.w3 = Linear(hidden_size, intermediate_size)
        self.w2 = Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(clamped_swiglu(self.w1(x), self.w3(x), self.limit))


class DeepseekV4MoE(FusedMoE):
    """FusedMoE with V4's routing (sqrtsoftplus scores, top-k or hash); the routed experts run in the fused MoE
    kernels with the ``silu_clamp`` activation (silu(min(g, limit)) * clamp(u, -limit, limit))."""

    def __init__(self, config: Any, hashed: bool) -> None:
        limit = float(config.swiglu_limit)
        shared = ClampedMLP(config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, limit)
        super().__init__(config.hidden_size, config.moe_intermediate_size, config.n_routed_experts,
                         config.num_experts_per_tok, renormalize=True, scoring=config.scoring_func,
                         routed_scaling_factor=config.routed_scaling_factor, correction_bias=not hashed,
                         activation="silu_clamp", swiglu_limit=limit, shared_experts=shared)
        if config.scoring_func not in ("sqrtsoftplus", "sigmoid", "softmax"):
            raise ValueError(f"unsupported DeepSeek-V4 scoring_func {config.scoring_func!r}")
        self.hashed = hashed
        self.tid2eid = (nn.Parameter(torch.zeros(config.vocab_size, config.num_experts_per_tok, dtype=torch.int64),
                                     requires_grad=False) if hashed else None)
        self._input_ids: torch.Tensor | None = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.gate(x).float()
        if self.scoring == "sqrtsoftplus":
            scores = F.softplus(logits).sqrt()
        elif self.scoring == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = logits.softmax(dim=-1)
        if self.hashed:
            assert self._input_ids is not None and self.tid2eid is not None
            if self._input_ids.shape[0] != x.shape[0]:  # expert parallel under TP routes a slice of the tokens
                raise NotImplementedError("hash-routed MoE layers need every token's id: expert parallelism with "
                                          "tensor parallelism is not supported for DeepSeek-V4")
            ids = self.tid2eid[self._input_ids]
        else:
            ids = torch.topk(scores + self.e_score_correction_bias, self.top_k, dim=-1, sorted=False).indices
        w = scores.gather(1, ids)
        w = w / (w.sum(dim=-1, keepdim=True) + 1e-20) * self.routed_scaling_factor
        return w, ids.to(torch.int32)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor | None = None) -> torch.Tensor:
        self._input_ids = input_ids
        try:
            return super().forward(x)
        finally:
            self._input_ids = None


class DeepseekV4Block(nn.Module):
    """One decoder layer on the hc_mult streams."""

    def __init__(self, config: Any, i: int) -> None:
        super().__init__()
        hc = (config.hidden_size, config.hc_mult, config.hc_sinkhorn_iters, config.hc_eps, config.rms_norm_eps)
        self.attn = DeepseekV4Attention(config, config.layer_types[i])
        self.ffn = DeepseekV4MoE(config, hashed=config.mlp_layer_types[i] == "hash_moe")
        self.attn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.ffn_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_attn = HyperConnection(*hc)
        self.hc_ffn = HyperConnection(*hc)

    def forward(self, h: torch.Tensor, batch: ForwardBatch, seq_of_token: torch.Tensor) -> torch.Tensor:
        x, post, comb = self.hc_attn(h)
        h = hc_expand(h, self.attn(self.attn_norm(x), batch, seq_of_token), post, comb)
        x, post, comb = self.hc_ffn(h)
        return hc_expand(h, self.ffn(self.ffn_norm(x), batch.input_ids), post, comb)


# checkpoint name -> ours, after the optional "model." prefix is dropped
_RENAMES = [
    (re.compile(r"^embed_tokens\."), "embed."),
    (re.compile(r"^hc_head\.hc_(fn|base|scale)$"), r"hc_head.\1"),
    (re.compile(r"^hc_head_(fn|base|scale)$"), r"hc_head.\1"),
    (re.compile(r"\.hc_(attn|ffn)_(fn|base|scale)$"), r".hc_\1.\2"),
    (re.compile(r"\.ffn\.gate\.bias$"), ".ffn.e_score_correction_bias"),
    (re.compile(r"\.ffn\.gate\.tid2eid$"), ".ffn.tid2eid"),
    (re.compile(r"\.attn\.kv_norm\."), ".attn.norm."),  # DeepSeek's module name for the KV RMSNorm
]


def v4_parameter_name(name: str) -> str:
    """Our parameter name for a checkpoint name in DeepSeek's layout (prefix already dropped)."""
    for pattern, repl in _RENAMES:
        name = pattern.sub(repl, name)
    return name


def load_v4_tensor(module: nn.Module, config: Any, name: str, tensor: torch.Tensor) -> list[str] | None:
    """The ``load_checkpoint_tensor`` hook of a module holding V4 blocks: the hash table ``tid2eid`` (checked)
    and per-expert tensors; None for the rest (plain parameters)."""
    if name.endswith(".ffn.tid2eid"):
        param = module.get_parameter(name)
        if tuple(param.shape) != tuple(tensor.shape):
            raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
        if int(tensor.min()) < 0 or int(tensor.max()) >= config.n_routed_experts:
            raise ValueError(f"tensor {name} names experts outside 0..{config.n_routed_experts - 1}")
        param.data.copy_(tensor)
        return [name]
    return load_expert_checkpoint_tensor(module, name, tensor)


def sequence_of_token(batch: ForwardBatch) -> torch.Tensor:
    """[T] the batch row (sequence) of each token."""
    q_lens = (batch.cu_seqlens_q[1:] - batch.cu_seqlens_q[:-1]).long()
    return torch.repeat_interleave(torch.arange(q_lens.shape[0], device=q_lens.device), q_lens,
                                   output_size=batch.num_tokens)


class DeepseekV4ForCausalLM(nn.Module):
    #: decode steps are written sync-free and pass the CPU run of the graph batch path, but no GPU has captured
    #: them yet: off until one has (tests/models/test_deepseek_v4.py::test_decode_through_the_graph_batch)
    supports_cuda_graphs = False

    def __init__(self, config: Any, max_position: int | None = None) -> None:
        super().__init__()
        self.config = config
        # max_position (the loader's): unused, RoPE angles are computed from the positions (no table)
        self.embed = VocabEmbedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekV4Block(config, i)
                                    for i in range(config.num_hidden_layers))
        self.hc_head = HyperHead(config.hidden_size, config.hc_mult, config.hc_eps, config.rms_norm_eps)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = LMHead(config.vocab_size, config.hidden_size)
        #: multi-token-prediction weights (``mtp.*``), kept on the CPU for a speculative proposer
        self.mtp_weights: dict[str, torch.Tensor] = {}

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, D] of every token of the batch."""
        return self.final_hidden(self.forward_streams(batch))

    def forward_streams(self, batch: ForwardBatch) -> torch.Tensor:
        """The hc_mult residual streams [T, n, D] after the last layer (what the MTP layer reads)."""
        seq_of_token = sequence_of_token(batch)
        e = self.embed(batch.input_ids)
        h = e.unsqueeze(1).expand(-1, self.config.hc_mult, -1).contiguous()
        for layer in self.layers:
            h = layer(h, batch, seq_of_token)
        return h

    def final_hidden(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [T, n, D] -> the hidden states [T, D] the head reads."""
        return self.norm(self.hc_head(streams))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.head(hidden)

    # ------------------------------------------------------------------ loading

    def remap_checkpoint_name(self, name: str) -> str | None:
        if name.startswith("mtp.") or name.startswith("model.mtp."):
            return name  # kept aside by load_checkpoint_tensor
        name = name.removeprefix("model.")
        if name == "lm_head.weight":
            return "head.weight"
        return v4_parameter_name(name)

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> list[str] | None:
        if name.startswith(("mtp.", "model.mtp.")):
            self.mtp_weights[name] = tensor.detach().to("cpu")
            return []
        return load_v4_tensor(self, self.config, name, tensor)

    #: integer checkpoint tensors this model takes itself (the loader offers them to load_checkpoint_tensor)
    integer_checkpoint_tensors = ("tid2eid",)
