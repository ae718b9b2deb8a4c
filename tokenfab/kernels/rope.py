"""Rotary position embedding applied to q and k with a precomputed cos/sin cache.

``cos_sin_cache`` is [max_positions, rotary_dim]: the first rotary_dim/2 columns hold
cos(pos * inv_freq), the last rotary_dim/2 hold sin. Scaled variants (Llama 3, YaRN,
linear) only change how the cache is built (``tokenfab/layers/rotary.py``); YaRN's
attention scaling ("mscale") is folded into the cache values.
Only the first ``rotary_dim`` channels of each head rotate (partial rotary).
"""

from __future__ import annotations

import torch

from tokenfab.kernels._dispatch import use_triton


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, is_neox: bool) -> torch.Tensor:
    # x: [T, H, rot]; cos/sin: [T, 1, rot/2]
    if is_neox:
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)


def rotary_embedding_ref(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """positions: [T] int; q: [T, Hq, D]; k: [T, Hk, D]. Returns rotated (q, k), new tensors.

    NeoX layout rotates the halves (x[:r/2], x[r/2:]); GPT-J layout rotates interleaved
    pairs (x[0::2], x[1::2]). Math runs in fp32 and is cast back to the input dtype.
    """
    rot = cos_sin_cache.shape[-1]
    cs = cos_sin_cache.index_select(0, positions.long()).float()
    cos, sin = cs[:, None, : rot // 2], cs[:, None, rot // 2 :]
    outs = []
    for x in (q, k):
        xr = _rotate(x[..., :rot].float(), cos, sin, is_neox).to(x.dtype)
        if rot < x.shape[-1]:
            xr = torch.cat((xr, x[..., rot:]), dim=-1)
        outs.append(xr)
    return outs[0], outs[1]


def _rotary_embedding_triton(positions, q, k, cos_sin_cache, is_neox):
    raise NotImplementedError("Triton rotary_embedding not written yet")


@torch.library.custom_op("tokenfab::rotary_embedding", mutates_args=())
def rotary_embedding(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    is_neox: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    if use_triton(q):
        return _rotary_embedding_triton(positions, q, k, cos_sin_cache, is_neox)
    return rotary_embedding_ref(positions, q, k, cos_sin_cache, is_neox)


@rotary_embedding.register_fake
def _(positions, q, k, cos_sin_cache, is_neox):
    return torch.empty_like(q), torch.empty_like(k)
