"""Multi-head latent attention (MLA; DeepSeek-V2/V3, Kimi K2, the attention of DeepSeek-V3.2 / GLM-5).

For a token x (hidden size D) and H heads of ``qk_nope + qk_rope`` query/key dims, ``v`` value dims:

    q      = W_qb RMSNorm(W_qa x)  (or W_q x when q_lora_rank is None)      [H, nope + rope]
    c, kr  = split(W_kva x, [r, rope]);  c = RMSNorm(c)                       latent [r], rope key [rope]
    q_pe, kr = RoPE(q_pe), RoPE(kr)                                           one rope key shared by all heads
    [k_nope_h ; v_h] = W_kvb[h] c                                              W_kvb: kv_b_proj, [H (nope + v), r]
    o_h    = softmax(scale (q_nope_h . k_nope_h + q_pe_h . kr)) v_h;   out = W_o [o_1 .. o_H]

The cache stores only ``[c ; kr]`` per token (``r + rope`` values, one "head"), not the H expanded
keys and values. Attention runs in the absorbed form: with W_UK[h] = W_kvb[h][:nope] and
W_UV[h] = W_kvb[h][nope:], ``q_nope_h . k_nope_h = (W_UK[h]^T q_nope_h) . c``, so the query is
projected into the latent space, attends over the latent cache (``tokenfab.kernels.mla``), and
the latent output is mapped back by W_UV[h]. Both projections are batched matrix products over
the heads with views of kv_b_proj's weight (no copies, nothing to prepare after loading). Steps with
a long query chunk (``MLAAttention.expand_min_query_len``) instead expand the cached latents to
per-head keys and values and run the paged prefill attention kernel (the same math).

Module names follow the Hugging Face checkpoints (``self_attn.q_a_proj`` ...), so weights load by name.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenfab.forward_batch import ForwardBatch
from tokenfab.kernels import mla_attention, paged_attention, store_latent
from tokenfab.kernels.paged import gather_kv
from tokenfab.layers.linear import Linear
from tokenfab.layers.norm import RMSNorm
from tokenfab.layers.rotary import RotaryEmbedding
from tokenfab.layers.tp_split import local_heads
from tokenfab.quant.kv_fp8 import calibrate_scale_


def mla_attend(q: torch.Tensor, kv_cache: torch.Tensor, batch: ForwardBatch, scale: float,
               kv_lora_rank: int, kv_scale: torch.Tensor | None = None) -> torch.Tensor:
    """MLA over the latent cache (``kernels.mla_attention``: Triton or the reference by the kernel rule);
    ``kv_scale``: the FP8 cache's scale (None: a cache in the model dtype)."""
    if kv_scale is None:
        return mla_attention(q, kv_cache, batch.block_tables, batch.cu_seqlens_q, batch.context_lens,
                             batch.max_query_len, batch.max_context_len, scale, kv_lora_rank)
    return mla_attention(q, kv_cache, batch.block_tables, batch.cu_seqlens_q, batch.context_lens, batch.max_query_len,
                         batch.max_context_len, scale, kv_lora_rank, kv_scale=kv_scale)


class MLAAttention(nn.Module):
    """The paged core of MLA: writes each token's (latent, rope key) to the cache, attends in the
    absorbed form. Owns one cache tensor ``kv_cache`` [num_blocks, block_size, 1, r + rope (+ extra)],
    bound by the model runner from ``kv_cache_spec()`` (deliberately not an ``Attention``: no K/V
    pair). ``extra_dim`` values more per token are reserved after the rope key (DSA's index key)."""

    #: Steps with a query chunk at least this long run in the expanded form: every sequence's cached
    #: latents are expanded to per-head keys [W_UK c ; k_pe] and values W_UV c, and the paged prefill
    #: attention kernel (query tiles, tensor cores) runs over them. Cheaper than the absorbed form for
    #: long chunks (d_k = nope + rope instead of r + rope per product, and no per-token re-reads of the
    #: prefix); the absorbed form serves decode-heavy steps, where expanding the context would dominate.
    expand_min_query_len: int = 128
    EXPAND_BLOCK = 64  # page size of the temporary expanded K/V (a fixed constexpr for the kernel)
    #: The expansion covers every sequence of the step padded to the longest context; above this many
    #: K/V elements (e.g. a prefill chunk batched with many long decodes) the step stays absorbed.
    EXPAND_MAX_ELEMENTS = 1 << 27

    def __init__(self, num_heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
                 v_head_dim: int, scale: float, extra_dim: int = 0) -> None:
        super().__init__()
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.scale, self.extra_dim = scale, extra_dim
        self.kv_cache: torch.Tensor | None = None
        # FP8 latent cache (tokenfab/quant/kv_fp8.py): the cache dtype (None: the model's) and one float32 [1]
        # scale for the whole row (``kv_scale``, bound by the runner; ``kv_calibrate``: set it from the first batch)
        self.kv_cache_dtype: torch.dtype | None = None
        self.kv_scale: torch.Tensor | None = None
        self.kv_calibrate = False

    def kv_cache_spec(self) -> tuple[int, ...]:
        """Per-token shape of this layer's cache entry (the runner's dtype): one head of r + rope (+ extra) values."""
        return (1, self.kv_lora_rank + self.qk_rope_head_dim + self.extra_dim)

    def store(self, latent: torch.Tensor, rest: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Write latent [T, r] and ``rest`` [T, rope (+ extra)] into the tokens' slots; returns the cache."""
        assert self.kv_cache is not None, "MLA cache not bound: the model runner binds kv_cache"
        if self.kv_scale is None:
            store_latent(latent, rest, self.kv_cache, batch.slot_mapping)
            return self.kv_cache
        if self.kv_calibrate and latent.shape[0] > 0:  # one-shot: amax / 448 of the first batch's rows
            calibrate_scale_(self.kv_scale, torch.stack((latent.abs().amax(), rest.abs().amax())))
            self.kv_calibrate = False
        store_latent(latent, rest, self.kv_cache, batch.slot_mapping, scale=self.kv_scale)
        return self.kv_cache

    def absorb(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv_b_weight: torch.Tensor) -> torch.Tensor:
        """[T, H, nope], [T, H, rope] -> [T, H, r + rope]: q_nope mapped into the latent space by W_UK."""
        w = kv_b_weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        q_lat = torch.bmm(q_nope.transpose(0, 1), w[:, : self.qk_nope_head_dim])  # [H, T, r]
        return torch.cat((q_lat.transpose(0, 1), q_pe.to(q_lat.dtype)), dim=-1)

    def expand_out(self, o_lat: torch.Tensor, kv_b_weight: torch.Tensor) -> torch.Tensor:
        """[T, H, r] -> [T, H * v]: each head's latent output mapped through W_UV."""
        t = o_lat.shape[0]
        w = kv_b_weight.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim, self.kv_lora_rank)
        o = torch.bmm(o_lat.transpose(0, 1), w[:, self.qk_nope_head_dim :].transpose(1, 2))  # [H, T, v]
        return o.transpose(0, 1).reshape(t, self.num_heads * self.v_head_dim)

    def forward(self, q_nope: torch.Tensor, q_pe: torch.Tensor, latent: torch.Tensor, k_pe: torch.Tensor,
                kv_b_weight: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q_nope [T, H, nope], q_pe [T, H, rope] (rotated), latent [T, r] (normed), k_pe [T, rope]
        (rotated), kv_b_weight [H (nope + v), r] -> [T, H * v]."""
        cache = self.store(latent, k_pe, batch)
        if self.use_expanded(batch):
            return self.expanded(q_nope, q_pe, cache, kv_b_weight, batch)
        q = self.absorb(q_nope, q_pe, kv_b_weight)
        o_lat = mla_attend(q, cache, batch, self.scale, self.kv_lora_rank, self.kv_scale)  # [T, H, r]
        return self.expand_out(o_lat, kv_b_weight)

    def use_expanded(self, batch: ForwardBatch) -> bool:
        if batch.max_query_len < self.expand_min_query_len:
            return False
        n = -(-batch.max_context_len // self.EXPAND_BLOCK) * self.EXPAND_BLOCK
        per_key = self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim + self.v_head_dim)
        return batch.num_seqs * n * per_key <= self.EXPAND_MAX_ELEMENTS

    def expanded(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor, kv_b_weight: torch.Tensor,
                 batch: ForwardBatch) -> torch.Tensor:
        """The same attention with per-head K/V expanded from every sequence's cached latents -> [T, H * v]."""
        t, h, r = q_nope.shape[0], self.num_heads, self.kv_lora_rank
        nope, rope, dv = self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim
        b, bs = batch.num_seqs, self.EXPAND_BLOCK
        n = -(-batch.max_context_len // bs) * bs
        rows = gather_kv(cache[:, :, 0], batch.block_tables, batch.max_context_len)  # [B, L, width]
        if self.kv_scale is not None:  # FP8 latent cache: dequantized rows
            rows = (rows.float() * self.kv_scale).to(kv_b_weight.dtype)
        kv = F.linear(rows[..., :r], kv_b_weight).view(b, -1, h, nope + dv)
        k = torch.cat((kv[..., :nope], rows[:, :, None, r : r + rope].expand(-1, -1, h, -1)), dim=-1)
        pad = n - batch.max_context_len
        k = F.pad(k, (0, 0, 0, 0, 0, pad)).view(b * n // bs, bs, h, nope + rope)
        v = F.pad(kv[..., nope:], (0, 0, 0, 0, 0, pad)).reshape(b * n // bs, bs, h, dv)
        tables = torch.arange(b * n // bs, dtype=torch.int32, device=k.device).view(b, n // bs)
        q = torch.cat((q_nope, q_pe.to(q_nope.dtype)), dim=-1)
        o = paged_attention(q, k, v, tables, batch.cu_seqlens_q, batch.context_lens, batch.max_query_len,
                            batch.max_context_len, self.scale)
        return o.reshape(t, h * dv)


class MultiHeadLatentAttention(nn.Module):
    """The whole MLA block of a decoder layer: projections, norms, RoPE, the paged core, o_proj."""

    def __init__(
        self,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int | None,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
        scale: float,
        rotary_emb: RotaryEmbedding,
        bias: bool = False,
        norm_eps: float = 1e-6,
    ) -> None:
        super().__init__()
        # tensor parallel: the heads split over the ranks (q / q_b and kv_b column-parallel by head,
        # o_proj row-parallel with the all-reduce after attention); q_a and kv_a, and so the latent
        # cache, are per token and replicated. ``num_heads`` is this rank's.
        self.num_heads = local_heads(num_heads)
        self.q_lora_rank, self.kv_lora_rank = q_lora_rank, kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        qk_head_dim = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.q_proj = Linear(hidden_size, num_heads * qk_head_dim, parallel="column")
        else:
            self.q_a_proj = Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, norm_eps)
            self.q_b_proj = Linear(q_lora_rank, num_heads * qk_head_dim, parallel="column")
        self.kv_a_proj_with_mqa = Linear(hidden_size, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, norm_eps)
        self.kv_b_proj = Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), parallel="column")
        self.o_proj = Linear(num_heads * v_head_dim, hidden_size, bias=bias, parallel="row")
        self.rotary_emb = rotary_emb
        self.attn = MLAAttention(self.num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim, v_head_dim, scale)

    @property
    def ends_in_all_reduce(self) -> bool:  # two-batch overlap: o_proj's all-reduce is the last op
        return getattr(self.o_proj, "reduce_output", False)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        if self.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(t, self.num_heads, self.qk_nope_head_dim + self.qk_rope_head_dim)
        q_nope, q_pe = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent.contiguous())
        q_pe, k_pe = self.rotary_emb(batch.positions, q_pe, k_pe.reshape(t, 1, self.qk_rope_head_dim))
        o = self.attn(q_nope, q_pe, latent, k_pe, self.kv_b_proj.weight, batch)
        return self.o_proj(o)
