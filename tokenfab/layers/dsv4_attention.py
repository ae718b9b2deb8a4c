"""DeepSeek-V4 attention: shared-KV MQA over a sliding window plus compressed entries (CSA / HCA).

For a token x at position p (H heads of dim D, one KV head that is both key and value):

    q_resid = RMSNorm(W_qa x);   q = RoPE(RMSNorm_unweighted_per_head(W_qb q_resid))       [H, D]
    kv      = RoPE(RMSNorm(W_kv x))                                                      [D]  (K = V)
    keys    = kv of positions p - W + 1 .. p (the sliding window)
              + compressed entries (``dsv4_compressor``): HCA every visible entry, CSA the indexer's top-k
    o_h     = sum_j softmax([q_h . k_j / sqrt(D) ; sink_h])_j k_j      a learned per-head sink logit
    o_h     = RoPE^-1(o_h) at p (the values carried the keys' rotation; this undoes it on the rope slice)
    out     = W_ob [W_oa,g (o_heads of group g)]_g                       grouped low-rank output projection

RoPE rotates the trailing ``qk_rope_head_dim`` channels in consecutive pairs; sliding layers use the "main"
parameters, compressed layers the "compress" ones (their own theta, YaRN when configured).

The caches (bound by the model runner): ``ring`` [slots + 1, R, width], a state slot per sequence holding the
rows of its last R = ``token_rows_read()`` tokens (kv, then the compressors' C and Z rows: all a later step
reads of them), and ``comp_cache`` [num_blocks, max(1, bs // m), D (+ d_I)], the compressed entries in the
paged cache at the layout of ``CompressedLayout``. The attention streams the rows it names and the indexer
scores the entries it names (``kernels.dsv4_attention``: Triton, or the PyTorch references); the compressors
close their windows through ``kernels.dsv4_compressor`` (Triton, or its PyTorch reference), reading the slot
rows in place. Checkpoint names (the official
layout): ``layers.{i}.attn.{wq_a,q_norm,wq_b,wkv,norm,wo_a,wo_b,attn_sink,compressor.*,indexer.*}``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from tokenfab.forward_batch import ForwardBatch
from tokenfab.kernels import store_latent
from tokenfab.kernels.dsv4_attention import dsv4_sparse_attention
from tokenfab.layers.dsv4_compressor import (
    CompressedLayout,
    Compressor,
    InterleavedRope,
    LightningIndexer,
    TokenRows,
    close_windows,
)
from tokenfab.layers.hyper_connections import unweighted_rms_norm
from tokenfab.layers.linear import Linear
from tokenfab.layers.norm import RMSNorm

SLIDING, CSA, HCA = "sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"


def v4_rope_parameters(config: Any, kind: str) -> dict:
    """The "main" or "compress" RoPE parameters of a DeepseekV4Config (nested by rope kind)."""
    params = dict((getattr(config, "rope_parameters", None) or {}).get(kind) or {})
    params.setdefault("rope_type", "default")
    if params.get("rope_theta") is None:
        params["rope_theta"] = config.rope_theta if kind == "main" else config.compress_rope_theta
    if params["rope_type"] == "yarn":
        params.setdefault("attention_factor", 1.0)  # V4 does not scale cos/sin by YaRN's mscale
    return params


class DeepseekV4Attention(nn.Module):
    def __init__(self, config: Any, layer_type: str) -> None:
        super().__init__()
        if layer_type not in (SLIDING, CSA, HCA):
            raise ValueError(f"unknown DeepSeek-V4 layer type {layer_type!r}")
        h, d, eps = config.num_attention_heads, config.head_dim, config.rms_norm_eps
        self.layer_type, self.num_heads, self.head_dim, self.eps = layer_type, h, d, eps
        self.sliding_window = config.sliding_window
        self.o_groups, self.o_lora_rank = config.o_groups, config.o_lora_rank
        self.wq_a = Linear(config.hidden_size, config.q_lora_rank)
        self.q_norm = RMSNorm(config.q_lora_rank, eps)
        self.wq_b = Linear(config.q_lora_rank, h * d)
        self.wkv = Linear(config.hidden_size, d)
        self.norm = RMSNorm(d, eps)
        self.wo_a = Linear(h * d // config.o_groups, config.o_groups * config.o_lora_rank)
        self.wo_b = Linear(config.o_groups * config.o_lora_rank, config.hidden_size)
        self.attn_sink = nn.Parameter(torch.empty(h, dtype=torch.float32), requires_grad=False)
        rope_dim = int(d * config.partial_rotary_factor)
        params = v4_rope_parameters(config, "main" if layer_type == SLIDING else "compress")
        self.rotary = InterleavedRope(rope_dim, params, config.max_position_embeddings)
        self.ratio = 0 if layer_type == SLIDING else config.compress_rates[layer_type]
        self.compressor: Compressor | None = None
        self.indexer: LightningIndexer | None = None
        if layer_type != SLIDING:
            self.compressor = Compressor(config.hidden_size, d, self.ratio, layer_type == CSA, self.rotary, eps)
        if layer_type == CSA:
            self.indexer = LightningIndexer(config.hidden_size, config.q_lora_rank, config.index_n_heads,
                                            config.index_head_dim, self.ratio, config.index_topk, self.rotary, eps)
        self.ring: torch.Tensor | None = None  # [slots + 1, ring_len, token_width], bound by the runner
        self.kv_block_size = 0
        self.comp_cache: torch.Tensor | None = None
        self.kv_cache_dtype: torch.dtype | None = None  # no FP8 cache for these layers yet
        self.kv_calibrate = False

    # ------------------------------------------------------------------ cache shapes

    @property
    def token_width(self) -> int:
        """Values one token keeps in this layer's cache: its kv, then its compressor rows."""
        width = self.head_dim
        for comp in self._compressors():
            width += comp.row_width
        return width

    @property
    def entry_width(self) -> int:
        return self.head_dim + (self.indexer.head_dim if self.indexer is not None else 0)

    def _compressors(self) -> list[Compressor]:
        return [c for c in (self.compressor, self.indexer.compressor if self.indexer else None) if c is not None]

    def paged_cache_shapes(self, block_size: int) -> dict[str, tuple[int, ...]]:
        """Per-block shapes of this layer's paged caches (the runner binds [num_blocks, *shape]): the compressed
        entries, ``max(1, block_size // ratio)`` a block; none for a sliding layer."""
        if not self.ratio:
            return {}
        self.kv_block_size = block_size  # the runner asks last, when it binds: the entries' layout follows it
        return {"comp_cache": (CompressedLayout(block_size, self.ratio).rows_per_block, self.entry_width)}

    def token_rows_read(self) -> int:
        """How many trailing token rows a later step can still read: its window's, and the rows of the windows
        not yet pooled (CSA pools two). The ring keeps exactly these."""
        lookback = {SLIDING: 0, HCA: self.ratio, CSA: 2 * self.ratio}[self.layer_type]
        return max(self.sliding_window, lookback)

    def recurrent_state_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """The per-sequence ring of token rows (``runner/state_cache.py`` binds [slots + 1, *shape])."""
        return {"ring": ((self.token_rows_read() + self.speculative_rows, self.token_width), self.wkv.weight.dtype)}

    #: Extra ring rows for speculative decoding (``reserve_speculative_rows``); 0 without it.
    speculative_rows: int = 0

    def reserve_speculative_rows(self, k: int) -> None:
        """Make the ring safe for verifying up to ``k`` drafts (before the runner binds it). The ring is positional
        (position p at row p mod R), so nothing is folded into a state: a verify step writes the rows of its last
        real token and k drafts, and a rejected draft's row is written again when that position is recomputed.
        What must not happen is a rejected row overwriting a row a later step still reads; with R = (rows read) + k
        the oldest position a step can read, q - rows read (q >= the first rejected position), is never the
        slot of a position up to q - 1 + k. Compressed entries closed by a rejected draft are rewritten the same
        way before any query can see them (only windows complete at a query's position are visible)."""
        self.speculative_rows = max(self.speculative_rows, int(k))

    # ------------------------------------------------------------------ forward

    #: Queries attend in slices of at most this many gathered key elements (per slice: tokens x (window +
    #: compressed entries) x head_dim, plus the indexer's keys), so a long prefill chunk never gathers
    #: every entry for every token at once.
    gather_budget: int = 1 << 25

    def forward(self, x: torch.Tensor, batch: ForwardBatch, seq_of_token: torch.Tensor) -> torch.Tensor:
        assert self.ring is not None, "DeepSeek-V4 ring not bound: the model runner binds the state slots"
        t, h, d = x.shape[0], self.num_heads, self.head_dim
        pos = batch.positions
        q_resid = self.q_norm(self.wq_a(x))
        q = self.rotary(unweighted_rms_norm(self.wq_b(q_resid).view(t, h, d), self.eps), pos)
        kv = self.rotary(self.norm(self.wkv(x)), pos)
        new = torch.cat([kv] + [c.token_rows(x, pos) for c in self._compressors()], dim=-1)
        rows = TokenRows(new, self.ring, batch, seq_of_token)
        if self.ratio:
            self._close_windows(batch, rows)
        n = batch.max_context_len // self.ratio if self.ratio else 0
        per_token = (self.sliding_window + n) * d + (n * self.indexer.head_dim if self.indexer is not None else 0)
        step = max(1, self.gather_budget // max(1, per_token))
        o = torch.cat([self._attend_slice(q[i:i + step], x[i:i + step], q_resid[i:i + step], pos[i:i + step],
                                          seq_of_token[i:i + step], batch.block_tables, rows, n)
                       for i in range(0, t, step)]) if t else q
        rows.store(self.ring)  # after every read of this step
        g = self.o_groups
        w = self.wo_a.weight.view(g, self.o_lora_rank, h * d // g)
        grouped = torch.einsum("tgi,gri->tgr", o.reshape(t, g, h * d // g), w).reshape(t, g * self.o_lora_rank)
        return self.wo_b(grouped)

    def _attend_slice(self, q: torch.Tensor, x: torch.Tensor, q_resid: torch.Tensor, pos: torch.Tensor,
                      seq: torch.Tensor, tables: torch.Tensor, rows: TokenRows, n: int) -> torch.Tensor:
        """Queries of some tokens over their window rows (the ring's and this step's) and compressed entries
        (``kernels.dsv4_attention``: the rows are named by index, -1 for none) -> [S, H, D], rotated back."""
        kpos = pos.unsqueeze(1) - self.sliding_window + 1 + torch.arange(self.sliding_window, device=q.device)
        valid = kpos >= 0
        new_idx, ring_idx = rows.split(kpos.clamp(min=0), seq.unsqueeze(1))
        new_idx, ring_idx = torch.where(valid, new_idx, -1), torch.where(valid, ring_idx, -1)
        entries, idx_comp = rows.new, new_idx[:, :0]
        if self.ratio:
            assert self.comp_cache is not None
            entries = self.comp_cache.view(-1, self.entry_width)
            idx_comp = self._compressed_rows(x, q_resid, pos, seq, tables, entries, n)
        o = dsv4_sparse_attention(q, rows.ring, ring_idx, rows.new, new_idx, entries, idx_comp, self.attn_sink,
                                  self.head_dim**-0.5)
        return self.rotary(o, pos, inverse=True)

    def _close_windows(self, batch: ForwardBatch, rows: TokenRows) -> None:
        """Write the entries of the windows whose last token is in this step into ``comp_cache`` (decode steps:
        every token pooled, the closing ones stored, so that no step syncs with the host)."""
        assert self.comp_cache is not None and self.compressor is not None and self.kv_block_size
        d, pos, tables = self.head_dim, batch.positions, batch.block_tables
        layout = CompressedLayout(self.kv_block_size, self.ratio)
        every = batch.max_query_len == 1
        seq, window, main, closing = close_windows(self.compressor, rows, d, every)
        new = [main]
        if self.indexer is not None:
            new.append(close_windows(self.indexer.compressor, rows, d + self.compressor.row_width, every)[2])
        if window.numel():
            last = pos if every else (window + 1) * self.ratio - 1
            where = layout.closing_entry_rows(tables, seq, window, closing, last)
            entry = torch.cat(new, dim=-1).to(self.comp_cache.dtype)
            half = self.entry_width // 2
            store_latent(entry[:, :half], entry[:, half:], self.comp_cache.view(-1, 1, self.entry_width), where)

    def _compressed_rows(self, x: torch.Tensor, q_resid: torch.Tensor, pos: torch.Tensor, seq: torch.Tensor,
                         tables: torch.Tensor, entries: torch.Tensor, n: int) -> torch.Tensor:
        """The entry rows each token attends to [S, N'], -1 for none: HCA every visible entry of the N, CSA the
        indexer's top-k picks."""
        m = self.ratio
        layout = CompressedLayout(self.kv_block_size, m)
        ids = torch.arange(n, device=x.device)
        visible = ids.unsqueeze(0) < ((pos + 1) // m).unsqueeze(1)  # [S, N]
        at = layout.entry_rows(tables, seq.unsqueeze(1), ids.unsqueeze(0))  # [S, N]
        idx = torch.where(visible, at, -1)
        if self.indexer is None or n == 0:
            return idx
        picks = self.indexer.select(x, q_resid, pos, entries, self.head_dim, idx).long()
        return torch.where(picks >= 0, idx.gather(1, picks.clamp(min=0)), -1)

def cache_bytes_per_token(layers: list[DeepseekV4Attention], context_len: int, block_size: int,
                          dtype: torch.dtype) -> float:
    """Cache bytes per token of one sequence of ``context_len`` tokens over ``layers``: its compressed entries
    (whole blocks of them) and its ring of token rows in each layer, from the shapes the runner allocates."""
    blocks = -(-context_len // block_size)
    total = 0
    for a in layers:
        for shape in a.paged_cache_shapes(block_size).values():
            total += blocks * math.prod(shape)
        ring_shape, _ = a.recurrent_state_spec()["ring"]
        total += math.prod(ring_shape)
    return total * dtype.itemsize / context_len
