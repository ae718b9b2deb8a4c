"""DeepSeek-V4's KV compressors and lightning indexer, over the ring of token rows and the paged entries.

A compressor turns every ``m`` consecutive tokens (a window) into one compressed KV entry:

    C_j = W_kv x_j,  Z_j = W_gate x_j + B[j mod m]          per token, B: the learned ``ape`` [m, width]
    entry_w = RoPE(RMSNorm(sum_j softmax_j(Z_j) * C_j), position w m)   softmax over the window, per channel

HCA (heavily compressed, m = 128) sums over its own window. CSA (compressed sparse, m = 4) projects to
two series, Ca = [..., :d] and Cb = [..., d:]: entry w pools window w's Cb with window w-1's Ca (2m slots,
stride m; window 0's missing half has gate -inf). A query at position p may use the entries of the windows
that are complete at p: w < (p + 1) // m.

Where rows live: each token's C and Z rows (with its kv) are read from this step's own rows or, for positions
before the chunk, from the sequence's ring of recent rows (``TokenRows``; a window can close in a later chunk or
decode step). Paged layout of the entries (``CompressedLayout``): entry w is written once, when the window's
last token e = (w + 1) m - 1 is computed, into the block that holds e, at row (e mod bs) // m
(``max(1, bs // m)`` rows a block). Keeping the entry in the block of the window's last token makes it a
function of that block's prefix only, so prefix-cached blocks are never written by another sequence.

Lightning indexer (CSA only): its own compressor at ``index_head_dim``, queries ``q_I = W_qb' q_resid``
(RoPE at the token position) and head weights ``w = W_w x / sqrt(H_I)``;
``score(t, w) = sum_h w_h relu(q_I,h . k_w) / sqrt(d_I)``, top ``index_topk`` of the visible entries.
Checkpoint names: ``attn.compressor.{wkv,wgate,ape,norm}``, ``attn.indexer.{wq_b,weights_proj}`` and
``attn.indexer.compressor.*``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tokenfab.forward_batch import ForwardBatch
from tokenfab.kernels import store_latent
from tokenfab.kernels.dsv4_attention import dsv4_index_topk
from tokenfab.kernels.dsv4_compressor import dsv4_compress, interleaved_rope
from tokenfab.layers.linear import Linear
from tokenfab.layers.norm import RMSNorm
from tokenfab.layers.rotary import _llama3_inv_freq, _yarn_inv_freq


class InterleavedRope(nn.Module):
    """RoPE on the trailing ``rotary_dim`` channels, consecutive channel pairs (DeepSeek-V4's layout). cos/sin
    are computed from the positions (no [max_position, rotary_dim] table: V4 runs to 1M tokens)."""

    def __init__(self, rotary_dim: int, params: dict, max_position_embeddings: int) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        base = float(params["rope_theta"])
        rope_type = params.get("rope_type", "default")
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))
        self.scale = 1.0
        if rope_type == "yarn":
            inv_freq, self.scale = _yarn_inv_freq(rotary_dim, base, params, max_position_embeddings)
        elif rope_type == "linear":
            inv_freq = inv_freq / params["factor"]
        elif rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params, max_position_embeddings)
        elif rope_type not in ("default", None):
            raise ValueError(f"unsupported rope_type {rope_type!r}")
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """x [N, ..., d] rotated at positions [N] (``inverse``: by -angle)."""
        return interleaved_rope(x, positions, self.inv_freq, self.scale, inverse)


@dataclass
class CompressedLayout:
    """Where entries live: compressed entry w of sequence b at row table[b, e // bs] * R + (e % bs) // m of the
    entry cache viewed as [num_blocks * R, width], e = (w + 1) m - 1, R = max(1, bs // m)."""

    block_size: int
    ratio: int

    def __post_init__(self) -> None:
        bs, m = self.block_size, self.ratio
        if bs % m and m % bs:
            raise ValueError(f"block size {bs} and compression ratio {m}: one must divide the other")

    @property
    def rows_per_block(self) -> int:
        return max(1, self.block_size // self.ratio)

    def entry_rows(self, tables: torch.Tensor, seq: torch.Tensor, entry: torch.Tensor) -> torch.Tensor:
        end = (entry + 1) * self.ratio - 1
        bs = self.block_size
        return tables[seq, end // bs].long() * self.rows_per_block + (end % bs) // self.ratio

    def closing_entry_rows(self, tables: torch.Tensor, seq: torch.Tensor, window: torch.Tensor,
                           closing: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
        """``entry_rows`` where ``closing``, else -1 (a store skips it); ``last``: each row's token position,
        indexed instead where not closing so no lookup runs past a sequence's blocks."""
        end = torch.where(closing, (window + 1) * self.ratio - 1, last)
        bs = self.block_size
        rows = tables[seq, end // bs].long() * self.rows_per_block + (end % bs) // self.ratio
        return torch.where(closing, rows, -1)


class Compressor(nn.Module):
    """One compressed series at ``head_dim`` (``overlap``: CSA's two-series windows)."""

    def __init__(self, hidden_size: int, head_dim: int, ratio: int, overlap: bool, rope: InterleavedRope,
                 eps: float) -> None:
        super().__init__()
        self.head_dim, self.ratio, self.overlap = head_dim, ratio, overlap
        self.width = head_dim * (2 if overlap else 1)
        self.wkv = Linear(hidden_size, self.width)
        self.wgate = Linear(hidden_size, self.width)
        self.ape = nn.Parameter(torch.empty(ratio, self.width, dtype=torch.float32), requires_grad=False)
        self.norm = RMSNorm(head_dim, eps)
        self._rope = (rope,)  # shared with the attention, not a submodule of its own

    @property
    def row_width(self) -> int:
        """Values each token keeps in its cache row: its C and its biased Z."""
        return 2 * self.width

    def token_rows(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] -> [T, 2 width]: C, then Z + B[p mod m] (float32 bias added in the row's dtype)."""
        gate = self.wgate(x) + self.ape[positions % self.ratio].to(x.dtype)
        return torch.cat((self.wkv(x), gate), dim=-1)

    def compress(self, rows: TokenRows, slots: torch.Tensor, seq: torch.Tensor, window: torch.Tensor,
                 row_offset: int) -> torch.Tensor:
        """The entries [W, head_dim] of windows ``window`` [W] of sequences ``seq`` [W], pooled from the token rows
        at positions ``slots`` [W, S] (CSA: window w-1's m positions, then window w's; those of window -1 read
        nothing), ``comp``'s C and Z at columns ``row_offset`` onward, rotated at position w m
        (``kernels.dsv4_compressor.dsv4_compress``: Triton, or the PyTorch reference)."""
        new_row, ring_row = rows.split(slots, seq.unsqueeze(1))
        if self.overlap:
            none = (window == 0).unsqueeze(1) & (torch.arange(slots.shape[1], device=slots.device) < self.ratio)
            new_row, ring_row = new_row.masked_fill(none, -1), ring_row.masked_fill(none, -1)
        rope = self._rope[0]
        return dsv4_compress(rows.new, new_row, rows.ring, ring_row, window, row_offset, self.head_dim, self.ratio,
                             self.overlap, self.norm.weight, rope.inv_freq, rope.scale, self.norm.eps)


class TokenRows:
    """Where each token row a step reads lives: this step's own rows (``new`` [T, width]) for the positions of its
    chunk, else the sequence's ring (``ring`` [slots + 1, R, width]: position p of the slot's sequence at row
    p mod R, holding the last R positions before the chunk; ``batch.state_slots`` names the slot)."""

    def __init__(self, new: torch.Tensor, ring: torch.Tensor, batch: ForwardBatch, seq_of_token: torch.Tensor) -> None:
        self.new, self.ring, self.ring_len = new, ring.view(-1, ring.shape[-1]), ring.shape[1]
        assert batch.state_slots is not None, "DeepSeek-V4 keeps its token rows in state slots: the runner binds them"
        cu = batch.cu_seqlens_q.long()
        self.first_row = cu[:-1]
        self.first_pos = batch.positions[self.first_row.clamp(max=max(new.shape[0] - 1, 0))]
        self.last_pos = self.first_pos + (cu[1:] - cu[:-1]) - 1
        self.slot = batch.state_slots.long()
        self.seq_of_token, self.positions = seq_of_token, batch.positions

    def split(self, q: torch.Tensor, seq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions q (>= 0) of sequences seq -> (row of ``new`` or -1, row of the ring or -1)."""
        local = q >= self.first_pos[seq]
        new_row = self.first_row[seq] + q - self.first_pos[seq]
        ring_row = self.slot[seq] * self.ring_len + q % self.ring_len
        return torch.where(local, new_row, -1), torch.where(local, -1, ring_row)

    def store(self, ring: torch.Tensor) -> None:
        """After the layer has read everything: each chunk's last R rows into its ring (no host sync)."""
        seq, pos = self.seq_of_token, self.positions
        keep = pos > self.last_pos[seq] - self.ring_len
        dst = torch.where(keep, self.slot[seq] * self.ring_len + pos % self.ring_len, -1)
        half = self.new.shape[-1] // 2
        rows = self.new.to(ring.dtype)
        store_latent(rows[:, :half], rows[:, half:], ring, dst)


def close_windows(comp: Compressor, rows: TokenRows, row_offset: int, every_token: bool = False) -> tuple:
    """The windows whose last token is in this step: (seq [W], window [W], entries [W, d], closing [W]) pooled from
    the token rows (columns ``row_offset`` onward hold ``comp``'s C and Z). ``every_token`` (decode steps: no host
    sync, for CUDA graphs): one row per token, ``closing`` telling which are real (the others pooled from rows up
    to the token, never stored)."""
    m, positions = comp.ratio, rows.positions
    closing = (positions + 1) % m == 0
    ends = torch.arange(positions.shape[0], device=positions.device) if every_token else closing.nonzero().flatten()
    seq, window, last = rows.seq_of_token[ends], positions[ends] // m, positions[ends]
    if not every_token and ends.numel() == 0:
        return seq, window, rows.new.new_zeros(0, comp.head_dim), closing[ends]
    span = torch.arange(m, device=positions.device)
    start = torch.minimum((window * m).unsqueeze(1) + span, last.unsqueeze(1))  # [W, m], never past the token
    slots = torch.cat(((start - m).clamp(min=0), start), dim=1) if comp.overlap else start
    return seq, window, comp.compress(rows, slots, seq, window, row_offset), closing[ends]


class LightningIndexer(nn.Module):
    def __init__(self, hidden_size: int, q_lora_rank: int, n_heads: int, head_dim: int, ratio: int, topk: int,
                 rope: InterleavedRope, eps: float) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = n_heads, head_dim, topk
        self.wq_b = Linear(q_lora_rank, n_heads * head_dim)
        self.weights_proj = Linear(hidden_size, n_heads)
        self.compressor = Compressor(hidden_size, head_dim, ratio, True, rope, eps)
        self._rope = (rope,)

    def select(self, x: torch.Tensor, q_resid: torch.Tensor, positions: torch.Tensor, entries: torch.Tensor,
               col: int, idx: torch.Tensor) -> torch.Tensor:
        """Score the entry rows ``idx`` [T, N] (-1: not visible; the index key at columns ``col``) of
        ``entries`` -> the top-k positions into ``idx`` [T, topk] int32, -1 where fewer are visible
        (``kernels.dsv4_attention.dsv4_index_topk``)."""
        t = x.shape[0]
        q = self._rope[0](self.wq_b(q_resid).view(t, self.n_heads, self.head_dim), positions)
        w = self.weights_proj(x).float() * self.n_heads**-0.5
        return dsv4_index_topk(q, w, entries, idx, col, self.topk)
