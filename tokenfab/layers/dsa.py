"""DeepSeek Sparse Attention (DSA): MLA whose queries attend only to the top-k keys a lightning
indexer picks (DeepSeek-V3.2, GLM-5 / GLM-MoE-DSA).

Indexer (its own small heads, Hi of dim di, the first ``rope`` dims rotated):

    q_idx = W_qb' q_resid                 q_resid = RMSNorm(W_qa x), shared with MLA's query path
    k_idx = LayerNorm(W_k x)              one key per token, cached beside the latent
    w     = W_w x * Hi^-0.5 * di^-0.5
    score(t, j) = sum_h w_h relu(q_idx_h . k_idx_j);   keep the ``index_topk`` best keys j <= t

GLM-MoE-DSA's "shared" layers run no indexer and reuse the selection of the previous "full" layer.
Checkpoint names: ``self_attn.indexer.{wq_b,wk,k_norm,weights_proj}``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenfab.forward_batch import ForwardBatch
from tokenfab.kernels import dsa_sparse_attention, dsa_topk_indices
from tokenfab.layers.linear import Linear
from tokenfab.layers.mla import MLAAttention, MultiHeadLatentAttention
from tokenfab.layers.rotary import RotaryEmbedding


class LayerNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class LightningIndexer(nn.Module):
    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, rotary: RotaryEmbedding,
                 topk: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = n_heads, head_dim, topk
        self.wq_b = Linear(q_lora_rank, n_heads * head_dim)
        self.wk = Linear(hidden_size, head_dim)
        self.k_norm = LayerNorm(head_dim)
        self.weights_proj = Linear(hidden_size, n_heads)
        self.rotary_emb = rotary  # rotates the first rope dims of q_idx / k_idx
        self.weight_scale = n_heads**-0.5 * head_dim**-0.5

    def project(self, x: torch.Tensor, q_resid: torch.Tensor, positions: torch.Tensor):
        """-> (q_idx [T, Hi, di], k_idx [T, di], head weights [T, Hi] fp32, scales folded in)."""
        t = x.shape[0]
        q = self.wq_b(q_resid).view(t, self.n_heads, self.head_dim)
        k = self.k_norm(self.wk(x)).view(t, 1, self.head_dim)
        q, k = self.rotary_emb(positions, q, k)
        w = self.weights_proj(x).float() * self.weight_scale
        return q, k.view(t, self.head_dim), w


class SparseLatentAttention(MultiHeadLatentAttention):
    """MLA (low-rank q path required) with DSA. ``indexer`` None: a "shared" layer that reuses the
    selection of ``topk_source`` (the previous full layer, run earlier in the same step)."""

    tbo_unsafe = True  # two-batch overlap: layers read the previous full layer's last_indices (one batch's)

    def __init__(self, *args, indexer: LightningIndexer | None, index_head_dim: int,
                 topk_source: SparseLatentAttention | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if self.q_lora_rank is None:
            raise ValueError("DSA needs the low-rank query path (q_lora_rank)")
        if indexer is None and topk_source is None:
            raise ValueError("a shared DSA layer needs a previous layer with an indexer")
        self.index_head_dim = index_head_dim
        self.indexer = indexer
        # a plain attribute holder, so the source is not registered as a submodule twice
        self._topk_source = (topk_source,)
        self.last_indices: torch.Tensor | None = None
        # the cache row: latent, rope key, index key (uniform over layers, also for shared ones)
        self.attn = MLAAttention(self.num_heads, self.kv_lora_rank, self.qk_nope_head_dim, self.qk_rope_head_dim,
                                 self.v_head_dim, self.attn.scale, extra_dim=index_head_dim)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t, r = x.shape[0], self.kv_lora_rank
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(t, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([r, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = self.rotary_emb(batch.positions, q_pe, k_pe.reshape(t, 1, self.qk_rope_head_dim))
        k_pe = k_pe.reshape(t, self.qk_rope_head_dim)
        if self.indexer is not None:
            q_idx, k_idx, w = self.indexer.project(x, q_resid, batch.positions)
            cache = self.attn.store(latent, torch.cat((k_pe, k_idx.to(k_pe.dtype)), dim=-1), batch)
            indices = dsa_topk_indices(q_idx, w, cache, batch.block_tables, batch.cu_seqlens_q, batch.context_lens,
                                       batch.max_query_len, batch.max_context_len, r + self.qk_rope_head_dim,
                                       self.indexer.topk)
        else:
            cache = self.attn.store(latent, k_pe, batch)
            source = self._topk_source[0]
            assert source is not None and source.last_indices is not None, "the full DSA layer must run first"
            indices = source.last_indices
        self.last_indices = indices
        qa = self.attn.absorb(q_nope, q_pe, self.kv_b_proj.weight)
        kv = {} if self.attn.kv_scale is None else {"kv_scale": self.attn.kv_scale}  # an FP8 latent cache's scale
        o_lat = dsa_sparse_attention(qa, cache, batch.block_tables, batch.cu_seqlens_q, batch.context_lens, indices,
                                     self.attn.scale, r, **kv)
        return self.o_proj(self.attn.expand_out(o_lat, self.kv_b_proj.weight))
