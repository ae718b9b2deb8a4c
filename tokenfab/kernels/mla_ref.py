"""The MLA reference (``mla.py``'s kernels' twin): multi-query attention of the absorbed queries over
the gathered latent rows, batched over the sequences, fp32 softmax, long prefills in query chunks."""

from __future__ import annotations

import torch

from tokenfab.kernels.kv_cache import check_latent_fp8, latent_rows, raw_cache
from tokenfab.kernels.paged import flat_cache, gather_kv, pad_queries

# The references process long prefills in query chunks of about this many score elements (fp32).
REF_CHUNK_ELEMENTS = 1 << 26


def mla_attention_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    max_context_len: int,
    scale: float,
    kv_lora_rank: int,
    kv_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [T, H, r + rope] -> o_lat [T, H, r]. Batched over all sequences, no Python loop.

    The pages are gathered into one padded [B, L, D] block; queries are scattered into
    [B, max_query_len * H, D] (heads folded into rows: one key head serves all of them); one
    masked softmax over the whole batch, in fp32.
    """
    t, h, d = q.shape
    b = context_lens.shape[0]
    r = kv_lora_rank
    if t == 0 or b == 0:
        return q.new_empty(t, h, r)
    cache = flat_cache(kv_cache)
    check_latent_fp8("mla_attention", q, cache, kv_scale)
    c = latent_rows(cache, gather_kv(raw_cache(cache), block_tables, max_context_len)[..., :d], kv_scale)  # [B, L, D]
    q_pad, seq_idx, tok_idx, mask = pad_queries(q, cu_seqlens_q, context_lens, max_query_len, max_context_len)
    out = q.new_empty(b, max_query_len, h, r)
    # query positions in chunks, so the [B, chunk * H, L] logits stay bounded on long prefills
    step = max(1, REF_CHUNK_ELEMENTS // max(1, b * h * max_context_len))
    for q0 in range(0, max_query_len, step):
        q1 = min(q0 + step, max_query_len)
        qc = q_pad[:, q0:q1].float().reshape(b, (q1 - q0) * h, d)
        logits = (torch.matmul(qc, c.transpose(1, 2)) * scale).view(b, q1 - q0, h, -1)
        logits = logits.masked_fill(~mask[:, q0:q1, None, :], float("-inf"))
        probs = torch.softmax(logits, dim=-1).view(b, (q1 - q0) * h, -1)
        out[:, q0:q1] = torch.matmul(probs, c[..., :r]).view(b, q1 - q0, h, r).to(q.dtype)
    if max_query_len == 1:
        return out.view(b, h, r)
    return out[seq_idx, tok_idx]
