"""Paged attention layer: writes this step's K/V into the cache, then attends over it."""

from __future__ import annotations

import torch
from torch import nn

from tokenfab.forward_batch import ForwardBatch
from tokenfab.kernels import paged_attention, store_kv
from tokenfab.quant.kv_fp8 import calibrate_scale_


class Attention(nn.Module):
    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        sliding_window: int = 0,
        softcap: float = 0.0,
        use_sinks: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale, self.sliding_window, self.softcap = scale, sliding_window or 0, softcap
        self.sinks = nn.Parameter(torch.zeros(num_heads), requires_grad=False) if use_sinks else None
        # Bound by the model runner to this layer's slices of the KV cache.
        self.k_cache: torch.Tensor | None = None
        self.v_cache: torch.Tensor | None = None
        # FP8 KV cache (tokenfab/quant/kv_fp8.py): the cache dtype (None: the model's), and the
        # float32 [1] scales the runner binds; kv_calibrate: set them from the first batch written
        self.kv_cache_dtype: torch.dtype | None = None
        self.k_scale: torch.Tensor | None = None
        self.v_scale: torch.Tensor | None = None
        self.kv_calibrate = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """q: [T, Hq, D], k/v: [T, Hkv, D] -> [T, Hq, D]."""
        assert self.k_cache is not None, "KV cache not bound: call ModelRunner.bind_kv_cache"
        if self.k_scale is None:
            store_kv(k, v, self.k_cache, self.v_cache, batch.slot_mapping)
            return paged_attention(
                q, self.k_cache, self.v_cache, batch.block_tables, batch.cu_seqlens_q, batch.context_lens,
                batch.max_query_len, batch.max_context_len, self.scale, self.sliding_window, self.softcap,
                self.sinks,
            )
        if self.kv_calibrate and k.shape[0] > 0:  # one-shot: amax / 448 of the first batch, on the device
            calibrate_scale_(self.k_scale, k)
            calibrate_scale_(self.v_scale, v)
            self.kv_calibrate = False
        store_kv(k, v, self.k_cache, self.v_cache, batch.slot_mapping, k_scale=self.k_scale, v_scale=self.v_scale)
        return paged_attention(
            q, self.k_cache, self.v_cache, batch.block_tables, batch.cu_seqlens_q, batch.context_lens,
            batch.max_query_len, batch.max_context_len, self.scale, self.sliding_window, self.softcap,
            self.sinks, k_scale=self.k_scale, v_scale=self.v_scale,
        )
