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
- ``k_scale``, ``v_scale`` (float32 [1] tensors): the scales of an fp8 (``float8_e4m3fn``) cache,
  whose values read as ``fp8.float() * scale`` (``kernels/kv_cache.py``); required for an fp8
  cache, ignored otherwise.

The implementations live in one file per concept: ``attention_ref`` (the PyTorch references),
``attention_decode`` (the Triton split-KV decode kernel), ``attention_prefill`` (the Triton
prefill kernel), ``paged`` (the helpers shared with MLA and DSA) and ``kernels/cpu`` (the native C
kernel). This module holds the op the layers call and re-exports the names the tests and
benchmarks use.
"""

from __future__ import annotations

import torch

from tokenfab.kernels._dispatch import kernel_op
from tokenfab.kernels.attention_decode import _paged_decode_attention_triton, decode_config
from tokenfab.kernels.attention_prefill import PREFILL_TILES, _prefill_attention_triton, prefill_config
from tokenfab.kernels.attention_ref import (
    FRESH_PREFILL_GROUPS,
    paged_attention_ref,
    paged_decode_attention_ref,
    prefill_attention_ref,
)
from tokenfab.kernels.batch_invariant import SHORT_EXTEND_ROWS, batch_invariant
from tokenfab.kernels.cpu import attention as native_attention
from tokenfab.kernels.kv_cache import is_fp8
from tokenfab.kernels.paged import LOG2E, MAX_DECODE_SPLITS

__all__ = [
    "FRESH_PREFILL_GROUPS",
    "LOG2E",
    "MAX_DECODE_SPLITS",
    "PREFILL_TILES",
    "decode_config",
    "paged_attention",
    "paged_attention_cpu",
    "paged_attention_native",
    "paged_attention_ref",
    "paged_decode_attention_ref",
    "prefill_attention_ref",
    "prefill_config",
]


def paged_attention_native(
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
) -> torch.Tensor | None:
    """The native C kernel (``kernels/cpu``), which reads the pages in place for decode rows and
    prefill chunks alike, in one call per layer; None where it cannot take the tensors.
    An fp8 cache's scales go to it as keywords (``k_scale=``, ``v_scale=``), only for an fp8 cache."""
    if q.shape[0] == 0 or not native_attention.supports(q, k_cache, v_cache):
        return None
    fp8 = {"k_scale": k_scale, "v_scale": v_scale} if is_fp8(k_cache.dtype) else {}
    if max_query_len == 1:
        return native_attention.paged_decode_attention_native(
            q, k_cache, v_cache, block_tables, context_lens, scale, sliding_window, softcap, sinks, **fp8)
    return native_attention.paged_attention_native(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                                   scale, sliding_window, softcap, sinks, **fp8)


def paged_attention_cpu(*args, **kwargs) -> torch.Tensor:
    """The native kernel where it takes the tensors, else the reference (``paged_attention_ref``'s
    signature), whatever ``TOKENFAB_KERNELS`` says (tests of the C kernel call it directly)."""
    out = paged_attention_native(*args, **kwargs)
    return out if out is not None else paged_attention_ref(*args, **kwargs)


def _paged_attention_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_query_len,
                            max_context_len, scale, sliding_window=0, softcap=0.0, sinks=None, k_scale=None,
                            v_scale=None) -> torch.Tensor:
    """Decode-only steps run the split-KV decode kernel, any other step the prefill kernel; in
    batch-invariant mode the rows of short extends (verify rows) run as decode rows."""
    if max_query_len == 1:
        return _paged_decode_attention_triton(
            q, k_cache, v_cache, block_tables, context_lens, max_context_len, scale, sliding_window, softcap, sinks,
            k_scale, v_scale,
        )
    if batch_invariant() and q.shape[0] > 0:
        return _invariant_extend_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens,
                                        max_query_len, max_context_len, scale, sliding_window, softcap, sinks,
                                        k_scale, v_scale)
    return _prefill_attention_triton(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_query_len, max_context_len, scale,
        sliding_window, softcap, sinks, k_scale, v_scale,
    )


def _invariant_extend_triton(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_query_len,
                             max_context_len, scale, sliding_window, softcap, sinks, k_scale, v_scale):
    """A step with extends, batch-invariant (``kernels.batch_invariant``): every row of a sequence
    with at most ``SHORT_EXTEND_ROWS`` query rows becomes one decode work item (the sequence's block
    table, ``context_len - (q_len - 1 - i)`` keys for its row i), so the split-KV decode kernel,
    whose split count is fixed in this mode, computes it exactly as the decode step of that
    position would; longer chunks (prefill) run the prefill kernel. No host sync: the short rows
    of a mixed step are found on the device, at most ``T - max_query_len`` of them (the longest
    chunk is not short) and at most ``SHORT_EXTEND_ROWS`` per other sequence."""
    t, b, dev = q.shape[0], context_lens.shape[0], q.device
    cu = cu_seqlens_q.long()
    q_lens = cu[1:] - cu[:-1]
    seq = torch.repeat_interleave(torch.arange(b, device=dev), q_lens, output_size=t)
    row_ctx = (context_lens.long()[seq] - (cu[1:][seq] - 1 - torch.arange(t, device=dev))).to(torch.int32)

    def decode_rows(rows, ctx):
        return _paged_decode_attention_triton(
            q.index_select(0, rows), k_cache, v_cache, block_tables.index_select(0, seq[rows]), ctx,
            max_context_len, scale, sliding_window, softcap, sinks, k_scale, v_scale)

    if max_query_len <= SHORT_EXTEND_ROWS:
        return decode_rows(torch.arange(t, device=dev), row_ctx)
    out = _prefill_attention_triton(
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_query_len, max_context_len, scale,
        sliding_window, softcap, sinks, k_scale, v_scale,
    )
    n = min(t - max_query_len, SHORT_EXTEND_ROWS * (b - 1))
    if n <= 0:
        return out
    short = (q_lens <= SHORT_EXTEND_ROWS)[seq]
    rows = torch.argsort((~short).to(torch.int8), stable=True)[:n]  # every short row, then long ones
    keep = short[rows]
    dec = decode_rows(rows, torch.where(keep, row_ctx[rows], 0))  # a long row: no keys, dropped below
    return out.index_copy_(0, rows, torch.where(keep[:, None, None], dec, out.index_select(0, rows)))


def _paged_attention_fake(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, *_) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], v_cache.shape[-1])


paged_attention = kernel_op(
    "paged_attention", _paged_attention_triton, paged_attention_ref, _paged_attention_fake,
    native=paged_attention_native,
    doc="The model's one attention call per layer per step (mixed prefill/decode batch).",
)
