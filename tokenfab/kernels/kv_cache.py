"""Writing a flat batch's new keys and values into the paged KV cache.

Cache layout: k_cache, v_cache are [num_blocks, block_size, num_kv_heads, head_dim].
Token t goes to slot ``slot_mapping[t]`` = block_id * block_size + offset; a slot of -1
is skipped (padding tokens of a CUDA-graph batch).
"""

from __future__ import annotations

import torch

from tokenfab.kernels._dispatch import use_triton


def store_kv_ref(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """k, v: [T, Hkv, D]; slot_mapping: [T] int64. Writes in place."""
    nb, bs, h, d = k_cache.shape
    valid = slot_mapping >= 0
    slots = slot_mapping[valid].long()
    k_cache.view(nb * bs, h, d).index_copy_(0, slots, k[valid].to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slots, v[valid].to(v_cache.dtype))


def _store_kv_triton(k, v, k_cache, v_cache, slot_mapping) -> None:
    raise NotImplementedError("Triton store_kv not written yet")


@torch.library.custom_op("tokenfab::store_kv", mutates_args=("k_cache", "v_cache"))
def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    if use_triton(k):
        _store_kv_triton(k, v, k_cache, v_cache, slot_mapping)
    else:
        store_kv_ref(k, v, k_cache, v_cache, slot_mapping)


@store_kv.register_fake
def _(k, v, k_cache, v_cache, slot_mapping):
    return None
