"""Attention over the paged KV cache, for a flat batch mixing prefill chunks and decodes.

Every op reads keys/values from the paged cache ``[num_blocks, block_size, Hkv, D]``;
the step's new keys/values were written there first (``store_kv``). Sequence ``b`` owns
the query tokens ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` and has ``context_lens[b]`` keys
in total (cached + new), so its i-th query sits at absolute position
``context_lens[b] - q_len[b] + i`` and attends causally to keys ``0..that position``.

Options shared by all variants:
- ``sliding_window`` > 0: a query at position p sees keys p - window + 1 .. p only.
- ``softcap`` > 0: logits become softcap * tanh(logits / softcap) before masking.
- ``sinks`` [Hq]: one extra learned logit per head that joins the softmax denominator
  but has no value (GPT-OSS).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenfab.kernels._dispatch import use_triton


def _gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, max_context_len: int) -> torch.Tensor:
    """[B, max_context_len, Hkv, D] gathered from the pages of each sequence."""
    bs = cache.shape[1]
    nblk = (max_context_len + bs - 1) // bs
    pages = cache[block_tables[:, :nblk].long()]  # [B, nblk, bs, Hkv, D]
    b = pages.shape[0]
    return pages.reshape(b, nblk * bs, *cache.shape[2:])[:, :max_context_len]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    max_context_len: int,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D] -> out [T, Hq, D]. Batched over all sequences, no loop.

    The pages are gathered into one padded [B, L, Hkv, D] block; queries are scattered
    into [B, max_query_len, Hq, D]; one masked attention runs over the whole batch.
    """
    t, hq, d = q.shape
    b = context_lens.shape[0]
    dv = v_cache.shape[-1]
    if t == 0 or b == 0:
        return q.new_empty(t, hq, dv)
    hkv = k_cache.shape[2]
    k = _gather_kv(k_cache, block_tables, max_context_len)
    v = _gather_kv(v_cache, block_tables, max_context_len)
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    ctx = context_lens.long()
    dev = q.device
    if max_query_len == 1:
        q_pad = q.view(b, 1, hq, d)
        seq_idx = tok_idx = None
    else:
        seq_idx = torch.repeat_interleave(torch.arange(b, device=dev), q_lens, output_size=t)
        tok_idx = torch.arange(t, device=dev) - cu_seqlens_q[:-1].long()[seq_idx]
        q_pad = q.new_zeros(b, max_query_len, hq, d)
        q_pad[seq_idx, tok_idx] = q
    i = torch.arange(max_query_len, device=dev)
    j = torch.arange(max_context_len, device=dev)
    qpos = (ctx - q_lens)[:, None] + i[None, :]  # [B, Q]
    mask = (j[None, None, :] <= qpos[:, :, None]) & (j[None, None, :] < ctx[:, None, None])
    if sliding_window > 0:
        mask &= j[None, None, :] > qpos[:, :, None] - sliding_window
    # Padded query rows (i >= q_len) see key 0 so the softmax stays finite; they are dropped.
    mask |= (i[None, :, None] >= q_lens[:, None, None]) & (j[None, None, :] == 0)
    qh = q_pad.transpose(1, 2)  # [B, Hq, Q, D]
    kh = k.transpose(1, 2)  # [B, Hkv, L, D]
    vh = v.transpose(1, 2)
    if softcap <= 0.0 and sinks is None and q.dtype == k.dtype:
        out = F.scaled_dot_product_attention(
            qh, kh, vh, attn_mask=mask[:, None], scale=scale, enable_gqa=hq != hkv
        )
    else:
        g = hq // hkv
        kf = kh.float().repeat_interleave(g, dim=1)
        vf = vh.float().repeat_interleave(g, dim=1)
        logits = torch.matmul(qh.float(), kf.transpose(-1, -2)) * scale
        if softcap > 0.0:
            logits = softcap * torch.tanh(logits / softcap)
        logits = logits.masked_fill(~mask[:, None], float("-inf"))
        if sinks is not None:
            sink = sinks.float().view(1, hq, 1, 1).expand(b, hq, max_query_len, 1)
            probs = torch.softmax(torch.cat((logits, sink), dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(logits, dim=-1)
        out = torch.matmul(probs, vf).to(q.dtype)
    out = out.transpose(1, 2)  # [B, Q, Hq, Dv]
    if max_query_len == 1:
        return out.reshape(b, hq, dv)
    return out[seq_idx, tok_idx]


def paged_decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    max_context_len: int,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, D] -> [B, Hq, D]."""
    b = q.shape[0]
    cu = torch.arange(b + 1, device=q.device, dtype=torch.int32)
    return paged_attention_ref(
        q, k_cache, v_cache, block_tables, cu, context_lens, 1, max_context_len, scale,
        sliding_window, softcap, sinks,
    )


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    max_context_len: int,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Variable-length causal attention of new query chunks against cached + new keys."""
    return paged_attention_ref(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_query_len,
        max_context_len, scale, sliding_window, softcap, sinks,
    )


def _paged_decode_attention_triton(
    q, k_cache, v_cache, block_tables, context_lens, max_context_len, scale, sliding_window, softcap, sinks
):
    raise NotImplementedError("Triton paged_decode_attention not written yet")


def _prefill_attention_triton(
    q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_query_len, max_context_len,
    scale, sliding_window, softcap, sinks,
):
    raise NotImplementedError("Triton prefill_attention not written yet")


@torch.library.custom_op("tokenfab::paged_attention", mutates_args=())
def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    max_context_len: int,
    scale: float,
    sliding_window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """The model's one attention call per layer per step (mixed prefill/decode batch)."""
    if use_triton(q):
        if max_query_len == 1:
            return _paged_decode_attention_triton(
                q, k_cache, v_cache, block_tables, context_lens, max_context_len, scale,
                sliding_window, softcap, sinks,
            )
        return _prefill_attention_triton(
            q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_query_len,
            max_context_len, scale, sliding_window, softcap, sinks,
        )
    return paged_attention_ref(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_query_len,
        max_context_len, scale, sliding_window, softcap, sinks,
    )


@paged_attention.register_fake
def _(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_query_len, max_context_len,
      scale, sliding_window=0, softcap=0.0, sinks=None):
    return q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
