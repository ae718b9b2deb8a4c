"""PyTorch references of paged attention (``tokenfab.kernels.attention``): the definition the
Triton and C kernels are tested against, and the CPU path when no native kernel takes the tensors.

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
- ``k_scale``, ``v_scale`` (float32 [1]): an fp8 cache's scales; the references dequantize the
  gathered pages (``fp8.float() * scale``) and apply the plain definition in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenfab.kernels.kv_cache import check_kv_dtypes, dequantize_fp8_ref, is_fp8
from tokenfab.kernels.paged import gather_kv, pad_queries


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, max_context_len: int,
            scale: torch.Tensor | None) -> torch.Tensor:
    """``gather_kv``; an fp8 cache is gathered as bytes and dequantized to fp32."""
    if not is_fp8(cache.dtype):
        return gather_kv(cache, block_tables, max_context_len)
    raw = gather_kv(cache.view(torch.uint8), block_tables, max_context_len).view(cache.dtype)
    return dequantize_fp8_ref(raw, scale)


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
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [T, Hq, D] -> out [T, Hq, D]. Batched over all sequences, no loop.

    The pages are gathered into one padded [B, L, Hkv, D] block; queries are scattered
    into [B, max_query_len, Hq, D]; one masked attention runs over the whole batch. In a
    mixed step the decodes (one query each) run as their own batch, so that they are not
    padded to the length of the step's longest prefill chunk.
    """
    t, hq, d = q.shape
    b = context_lens.shape[0]
    dv = v_cache.shape[-1]
    if t == 0 or b == 0:
        return q.new_empty(t, hq, dv)
    hkv = k_cache.shape[2]
    check_kv_dtypes("paged_attention", q, k_cache, v_cache, k_scale, v_scale)
    q_lens = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
    ctx = context_lens.long()
    plain = softcap <= 0.0 and sinks is None and sliding_window <= 0 and q.dtype == k_cache.dtype
    if max_query_len > 1:
        # decodes, fresh prompts (nothing cached: the is_causal path) and the rest each run as
        # their own batch, so that none is padded to another's longest row
        groups = [q_lens == 1]
        if plain:
            fresh = (q_lens == ctx) & (q_lens > 1)
            groups += [fresh, ~groups[0] & ~fresh]
        else:
            groups.append(~groups[0])
        present = [g for g in groups if bool(g.any())]
        if len(present) > 1:
            return _split_rows(paged_attention_ref, q, k_cache, v_cache, block_tables, cu_seqlens_q,
                               context_lens, q_lens, present, scale, sliding_window, softcap, sinks, k_scale,
                               v_scale)
        if plain and bool(groups[1].any()):
            return _fresh_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, q_lens, scale)
    k = _gather(k_cache, block_tables, max_context_len, k_scale)
    v = _gather(v_cache, block_tables, max_context_len, v_scale)
    q_pad, seq_idx, tok_idx, mask = pad_queries(q, cu_seqlens_q, context_lens, max_query_len, max_context_len,
                                                sliding_window)
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


# prompts of a fresh prefill are attended in this many groups of similar length
FRESH_PREFILL_GROUPS = 4


def _fresh_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, q_lens, scale) -> torch.Tensor:
    """Prompts with nothing cached: causal attention over right-padded rows, no mask tensor.

    With right padding, query i of a sequence sees keys 0..i, all of them its own (i < q_len),
    so SDPA's is_causal is exact for the real rows and skips the blocks above the diagonal;
    padded rows compute on finite cache contents and are dropped. The prompts are sorted by
    length and attended in a few groups, each padded only to its own longest prompt (for
    lengths spread evenly, 4 groups do about half the work of one padded batch).
    """
    t, hq, d = q.shape
    b = q_lens.shape[0]
    hkv = k_cache.shape[2]
    out = q.new_empty(t, hq, v_cache.shape[-1])
    order = torch.argsort(q_lens, descending=True, stable=True)
    starts = cu_seqlens_q[:-1].long()
    n_groups = min(FRESH_PREFILL_GROUPS, b)
    for g in range(n_groups):
        seqs = order[g * b // n_groups : (g + 1) * b // n_groups]
        lens = q_lens[seqs]
        longest = int(lens[0])
        seq_idx = torch.repeat_interleave(torch.arange(seqs.numel(), device=q.device), lens)
        first = torch.cumsum(lens, 0) - lens
        tok_idx = torch.arange(seq_idx.numel(), device=q.device) - first[seq_idx]
        rows = starts[seqs][seq_idx] + tok_idx  # the group's tokens in q
        q_pad = q.new_zeros(seqs.numel(), longest, hq, d)
        q_pad[seq_idx, tok_idx] = q[rows]
        k = gather_kv(k_cache, block_tables[seqs], longest)
        v = gather_kv(v_cache, block_tables[seqs], longest)
        o = F.scaled_dot_product_attention(
            q_pad.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True, scale=scale,
            enable_gqa=hq != hkv,
        )
        out[rows] = o.transpose(1, 2)[seq_idx, tok_idx]
    return out


def _split_rows(attend, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, q_lens, groups, scale,
                sliding_window, softcap, sinks, k_scale=None, v_scale=None) -> torch.Tensor:
    """``attend`` (a paged_attention variant) over each group of sequences (boolean masks over
    the batch) separately."""
    out = q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])
    for rows in (g.nonzero().squeeze(1) for g in groups):
        lens = q_lens[rows]
        cu = torch.zeros(rows.numel() + 1, dtype=cu_seqlens_q.dtype, device=q.device)
        cu[1:] = lens.cumsum(0)
        # the tokens of the chosen sequences, in order
        seq_of_token = torch.repeat_interleave(torch.arange(rows.numel(), device=q.device), lens)
        tokens = cu_seqlens_q[:-1].long()[rows][seq_of_token] + (
            torch.arange(seq_of_token.numel(), device=q.device) - cu[:-1].long()[seq_of_token])
        ctx = context_lens[rows]
        out[tokens] = attend(
            q[tokens], k_cache, v_cache, block_tables[rows], cu, ctx, int(lens.max()), int(ctx.max()), scale,
            sliding_window, softcap, sinks, k_scale, v_scale,
        )
    return out


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor, max_context_len: int,
                               *options, **kw_options) -> torch.Tensor:
    """One query token per sequence: q [B, Hq, D] -> [B, Hq, D]. ``options`` (``scale``, then the optional
    ``sliding_window``, ``softcap``, ``sinks``, ``k_scale``, ``v_scale``): ``paged_attention_ref``'s."""
    b = q.shape[0]
    cu = torch.arange(b + 1, device=q.device, dtype=torch.int32)
    return paged_attention_ref(q, k_cache, v_cache, block_tables, cu, context_lens, 1, max_context_len, *options,
                               **kw_options)


def prefill_attention_ref(*args, **kwargs) -> torch.Tensor:
    """Variable-length causal attention of new query chunks against cached + new keys: the prefill
    kernel's contract, ``paged_attention_ref``'s arguments and result."""
    return paged_attention_ref(*args, **kwargs)

