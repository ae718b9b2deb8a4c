"""Rotary position embedding for training, in Hugging Face's layout: Triton forward and backward
(Liger-Kernel's op as the model; issue 18).

``rope_train(q, k, cos, sin) -> (q_out, k_out)`` with q ``[B, Hq, T, D]``, k ``[B, Hk, T, D]`` (any
strides with the last dim contiguous: HF's ``view(...).transpose(1, 2)`` needs no copy) and cos/sin
``[B or 1, T, D]`` as ``LlamaRotaryEmbedding`` returns them. The math is HF's
``apply_rotary_pos_emb`` (NeoX / ``rotate_half`` style) with rotate_half(x) = [-x2, x1]:
    out1 = x1 * cos1 - x2 * sin1,   out2 = x2 * cos2 + x1 * sin2
(x1, x2: the halves of the head; cos1/cos2 the halves of cos, equal for HF's caches, kept apart so
any cos/sin works). The map is linear in x, so the backward is its transpose:
    dx1 = do1 * cos1 + do2 * sin2,  dx2 = do2 * cos2 - do1 * sin1
i.e. the same kernel with ``sin1 -> -sin2`` and ``sin2 -> -sin1``. The kernel computes in fp32 and
rounds once to the input dtype (HF rounds each product in bf16: within a rounding). No gradient
flows to cos/sin (HF's cos/sin come from a buffer with no gradient).

Paths: ``_rope_train_triton`` (CUDA, or ``TOKENFAB_KERNELS=triton``: the interpreter on CPU) and
``_rope_train_torch`` (HF's operations in the input dtype: CPU default, ``TOKENFAB_KERNELS=torch``), chosen in
the custom op ``tokenfab::rope_train`` that the ``autograd.Function`` calls forward and backward.
``rope_train_ref`` is the autograd oracle (HF's operations).
"""

from __future__ import annotations

import torch

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import check_device, next_pow2
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels._dispatch import kernel_op


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def rope_train_ref(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The oracle, differentiable by autograd: HF ``apply_rotary_pos_emb(q, k, cos, sin)`` (unsqueeze_dim 1)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


@triton.jit
def _rope_train_kernel(
    x_ptr, o_ptr, cos_ptr, sin_ptr,
    n_heads, T, half,
    sxb, sxh, sxt, sob, soh, sot, scb, sct,
    BACKWARD: tl.constexpr,
    BLOCK_HEADS: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    """Program (b * T + t, head block): rotate heads of token t of batch b (or the transpose)."""
    pid = tl.program_id(0)
    b = (pid // T).to(tl.int64)
    t = (pid % T).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    j = tl.arange(0, BLOCK_HALF)
    jm = j < half
    cs = b * scb + t * sct
    c1 = tl.load(cos_ptr + cs + j, mask=jm, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + cs + half + j, mask=jm, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + cs + j, mask=jm, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + cs + half + j, mask=jm, other=0.0).to(tl.float32)
    if BACKWARD:
        sa = -s2
        sb = -s1
    else:
        sa = s1
        sb = s2
    m = (heads < n_heads)[:, None] & jm[None, :]
    h64 = heads.to(tl.int64)[:, None]
    xrow = x_ptr + b * sxb + t * sxt + h64 * sxh
    orow = o_ptr + b * sob + t * sot + h64 * soh
    x1 = tl.load(xrow + j[None, :], mask=m, other=0.0).to(tl.float32)
    x2 = tl.load(xrow + half + j[None, :], mask=m, other=0.0).to(tl.float32)
    o1 = x1 * c1[None, :] - x2 * sa[None, :]
    o2 = x2 * c2[None, :] + x1 * sb[None, :]
    tl.store(orow + j[None, :], o1.to(o_ptr.dtype.element_ty), mask=m)
    tl.store(orow + half + j[None, :], o2.to(o_ptr.dtype.element_ty), mask=m)


def rope_config(n_heads: int, head_dim: int) -> dict:
    """Launch configuration (also used by the compile test)."""
    block_half = next_pow2(head_dim // 2)
    block_heads = max(1, min(next_pow2(n_heads), 2048 // block_half))
    tile = block_heads * block_half
    warps = 4 if tile >= 1024 else 2 if tile >= 256 else 1
    return dict(BLOCK_HEADS=block_heads, BLOCK_HALF=block_half, num_warps=warps)


def _cs_strides(cos: torch.Tensor) -> tuple[int, int]:
    return (cos.stride(0) if cos.shape[0] > 1 else 0), cos.stride(1)


def _rope_train_triton(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    check_device(x)
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.contiguous(), sin.contiguous()
    out = torch.empty_like(x)  # keeps x's layout (HF's transposed [B, H, T, D] views stay as they are)
    bsz, heads, seq, dim = x.shape
    if x.numel() == 0:
        return out
    cfg = rope_config(heads, dim)
    grid = (bsz * seq, triton.cdiv(heads, cfg["BLOCK_HEADS"]))
    _rope_train_kernel[grid](
        x, out, cos, sin, heads, seq, dim // 2,
        x.stride(0), x.stride(1), x.stride(2), out.stride(0), out.stride(1), out.stride(2), *_cs_strides(cos),
        BACKWARD=backward, **cfg,
    )
    return out


def _rope_train_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """HF's operations (the forward equals the reference; fp32 cos/sin under autocast promote, and the
    result is cast back to x's dtype); the backward applies the transpose of rotate_half,
    [v1, v2] -> [v2, -v1], to ``x * sin``."""
    c, s = cos.unsqueeze(1), sin.unsqueeze(1)
    if not backward:
        return (x * c + _rotate_half(x) * s).to(x.dtype)
    xs = x * s
    half = x.shape[-1] // 2
    return (x * c + torch.cat((xs[..., half:], -xs[..., :half]), dim=-1)).to(x.dtype)


rope_train_op = kernel_op(
    "rope_train", _rope_train_triton, _rope_train_torch, lambda x, *_: torch.empty_like(x),
    doc="One of q / k rotated (``backward``: the transposed rotation, applied to an upstream gradient).",
)


class RopeTrainFunction(torch.autograd.Function):
    """Saves only cos and sin: the backward is the forward kernel with the transposed rotation."""

    @staticmethod
    def forward(ctx, q, k, cos, sin):
        ctx.save_for_backward(cos, sin)
        op = torch.ops.tokenfab.rope_train
        return op(q, cos, sin, False), op(k, cos, sin, False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        op = torch.ops.tokenfab.rope_train
        dq = None if dq is None else op(dq, cos, sin, True)
        dk = None if dk is None else op(dk, cos, sin, True)
        return dq, dk, None, None


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"rope_train: q and k must be [B, H, T, D], got {tuple(q.shape)} and {tuple(k.shape)}")
    bsz, _, seq, dim = q.shape
    if k.shape[0] != bsz or k.shape[2:] != q.shape[2:]:
        raise ValueError(f"rope_train: k {tuple(k.shape)} does not match q {tuple(q.shape)} in B, T, D")
    if dim % 2:
        raise ValueError(f"rope_train: head dim must be even, got {dim}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dim() != 3 or t.shape[0] not in (1, bsz) or t.shape[1:] != (seq, dim):
            raise ValueError(f"rope_train: {name} must be [B or 1, T, D] = [{bsz}, {seq}, {dim}], "
                             f"got {tuple(t.shape)}")


def rope_train(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """HF ``apply_rotary_pos_emb`` with gradients for q and k (see the module doc)."""
    _check(q, k, cos, sin)
    return RopeTrainFunction.apply(q, k, cos, sin)
