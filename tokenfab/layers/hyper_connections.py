"""Manifold-constrained hyper-connections (mHC; DeepSeek-V4's residual stream, Xie et al. 2026).

The residual is ``n`` parallel streams h [T, n, D] instead of one. Around each block (attention or MoE):

    a          = RMSNorm_unweighted(flatten(h)) W^T          [T, (2 + n) n]   W: ``fn`` [(2 + n) n, n D]
    pre, post, comb = split(a, [n, n, n n])
    pre        = sigmoid(pre * s0 + b_pre) + eps             weights collapsing the streams into the block input
    post       = 2 sigmoid(post * s1 + b_post)               weights spreading the block output over the streams
    comb       = Sinkhorn(softmax(comb * s2 + b_comb) + eps) doubly stochastic (rows and columns sum to 1)
    x          = sum_j pre_j h_j                             -> the block (after its own RMSNorm)
    h'_k       = post_k f(x) + sum_j comb[j, k] h_j          (comb applied transposed: it is not symmetric)

Sinkhorn: columns normalized once, then ``iters - 1`` rounds of rows then columns, each with ``+ eps`` in
the denominator (transformers' order, so the bits agree). The final head collapses the streams with its
own ``pre`` weights only (``HyperHead``). The weights, the Sinkhorn projection and both mixes run as fused Triton
kernels (``tokenfab/kernels/mhc.py``; float32 inside, as the checkpoint keeps these weights).
Checkpoint names: ``layers.{i}.hc_{attn,ffn}_{fn,base,scale}``, ``hc_head_{fn,base,scale}``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenfab.kernels.mhc import mhc_post, mhc_pre


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def hc_collapse(streams: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """sum_j pre_j h_j: [T, n, D] -> [T, D] in the streams' dtype."""
    return (pre.unsqueeze(-1) * streams).sum(dim=1).to(streams.dtype)


def hc_expand(streams: torch.Tensor, out: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """h'_k = post_k out + sum_j comb[j, k] h_j -> [T, n, D] (``kernels.mhc.mhc_post``)."""
    return mhc_post(streams, out, post, comb)


class HyperConnection(nn.Module):
    """The mHC mixing around one block; ``fn``/``base``/``scale`` are the checkpoint's ``hc_{attn,ffn}_*``."""

    def __init__(self, hidden_size: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        n = hc_mult
        self.hc_mult, self.sinkhorn_iters, self.hc_eps, self.norm_eps = n, sinkhorn_iters, hc_eps, norm_eps
        self.fn = nn.Parameter(torch.empty((2 + n) * n, n * hidden_size, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.empty((2 + n) * n, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(3, dtype=torch.float32), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, n, D] -> (block input [T, D], post, comb)."""
        return mhc_pre(streams, self.fn, self.base, self.scale, self.sinkhorn_iters, self.hc_eps, self.norm_eps)


class HyperHead(nn.Module):
    """The last collapse of the streams before the final norm: sigmoid(a * s + b) + eps weights, no Sinkhorn."""

    def __init__(self, hidden_size: int, hc_mult: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.fn = nn.Parameter(torch.empty(hc_mult, hc_mult * hidden_size, dtype=torch.float32), requires_grad=False)
        self.base = nn.Parameter(torch.empty(hc_mult, dtype=torch.float32), requires_grad=False)
        self.scale = nn.Parameter(torch.empty(1, dtype=torch.float32), requires_grad=False)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        t = streams.shape[0]
        a = F.linear(unweighted_rms_norm(streams.reshape(t, -1).float(), self.norm_eps), self.fn.float())
        pre = torch.sigmoid(a * self.scale.float() + self.base.float()) + self.hc_eps
        return hc_collapse(streams, pre)
