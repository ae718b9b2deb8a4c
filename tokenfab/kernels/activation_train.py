"""Gated MLP activations for training, gate and up as separate tensors (HF's ``act_fn(gate_proj(x)) *
up_proj(x)``): Triton forward and backward (Liger-Kernel's SwiGLU / GEGLU as the model; issue 18).

``silu_and_mul_train(gate, up)`` and ``gelu_and_mul_train(gate, up, approximate="tanh" | "none")``
return ``act(gate) * up``. Numerics follow the HF module in the input dtype: the activation is
computed in fp32 and rounded to the input dtype, then multiplied by ``up`` and rounded again. The
backward recomputes the activation from the saved inputs (nothing else is stored), with
    d up = dout * act(gate),   d gate = dout * up * act'(gate)
    silu'(g) = sig(g) * (1 + g * (1 - sig(g)))
    gelu'(g) = Phi(g) + g * phi(g)                                         (erf)
    gelu_tanh'(g) = 0.5 * (1 + th) + 0.5 * g * (1 - th^2) * c * (1 + 3 a g^2),  th = tanh(c (g + a g^3))
in fp32.

Paths: ``_act_*_triton`` (CUDA, or ``TOKENFAB_KERNELS=triton``: the interpreter on CPU) and
``_act_*_torch`` (torch's fused activation and activation-backward ops, the same values as autograd
on the reference but only gate/up saved: CPU default, ``TOKENFAB_KERNELS=torch``), chosen in the
custom ops ``tokenfab::act_and_mul_train_fwd`` / ``_bwd`` that the ``autograd.Function`` calls.
``silu_and_mul_train_ref`` / ``gelu_and_mul_train_ref`` are the autograd oracles.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import check_device
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels._dispatch import kernel_op

ACTS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}
BLOCK = 1024


def silu_and_mul_train_ref(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The oracle (HF ``LlamaMLP``'s ``act_fn(gate) * up`` with SiLU)."""
    return F.silu(gate) * up


def gelu_and_mul_train_ref(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """The oracle (``gelu_pytorch_tanh`` for "tanh", exact ``gelu`` for "none")."""
    return F.gelu(gate, approximate=approximate) * up


@triton.jit
def _act_fwd_grad(g, ACT: tl.constexpr):
    """(act(g), act'(g)) in fp32; ACT 0 silu, 1 exact gelu, 2 tanh gelu."""
    if ACT == 0:
        sig = 1.0 / (1.0 + tl.exp(tl.minimum(-g, 80.0)))  # no overflow warning in the interpreter
        a = g * sig
        da = sig * (1.0 + g * (1.0 - sig))
    elif ACT == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        a = g * cdf
        da = cdf + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)
    else:
        inner = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        th = 1.0 - 2.0 / (tl.exp(tl.minimum(2.0 * inner, 80.0)) + 1.0)  # tanh(inner), no overflow
        a = 0.5 * g * (1.0 + th)
        da = 0.5 * (1.0 + th) + 0.5 * g * (1.0 - th * th) * 0.7978845608028654 * (1.0 + 0.134145 * g * g)
    return a, da


@triton.jit
def _act_and_mul_train_fwd_kernel(g_ptr, u_ptr, o_ptr, n, ACT: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    a, _ = _act_fwd_grad(g, ACT)
    a = a.to(o_ptr.dtype.element_ty).to(tl.float32)
    tl.store(o_ptr + offs, (a * u).to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def _act_and_mul_train_bwd_kernel(do_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, n, ACT: tl.constexpr,
                                  BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n
    do = tl.load(do_ptr + offs, mask=m, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + offs, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=m, other=0.0).to(tl.float32)
    a, da = _act_fwd_grad(g, ACT)
    a = a.to(g_ptr.dtype.element_ty).to(tl.float32)
    tl.store(du_ptr + offs, (do * a).to(du_ptr.dtype.element_ty), mask=m)
    tl.store(dg_ptr + offs, (do * u * da).to(dg_ptr.dtype.element_ty), mask=m)


def act_config() -> dict:
    """Launch configuration (also used by the compile test)."""
    return dict(BLOCK=BLOCK, num_warps=4)


def _act_fwd_triton(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    check_device(gate)
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    n = gate.numel()
    if n:
        _act_and_mul_train_fwd_kernel[(triton.cdiv(n, BLOCK),)](gate, up, out, n, ACT=ACTS[act], **act_config())
    return out


def _act_bwd_triton(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                    act: str) -> tuple[torch.Tensor, torch.Tensor]:
    check_device(gate)
    dout, gate, up = dout.contiguous(), gate.contiguous(), up.contiguous()
    dg, du = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    if n:
        _act_and_mul_train_bwd_kernel[(triton.cdiv(n, BLOCK),)](dout, gate, up, dg, du, n, ACT=ACTS[act],
                                                                **act_config())
    return dg, du


def _act_torch(g: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu":
        return F.silu(g)
    return F.gelu(g, approximate="tanh" if act == "gelu_tanh" else "none")


def _act_fwd_torch(gate: torch.Tensor, up: torch.Tensor, act: str) -> torch.Tensor:
    """The HF module's operations (torch computes the activation in fp32 and rounds, as the kernel)."""
    return _act_torch(gate, act) * up


def _act_bwd_torch(dout: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
                   act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The derivative by torch's fused activation-backward ops (what autograd on the reference runs)."""
    d_act = dout * up
    if act == "silu":
        dg = torch.ops.aten.silu_backward(d_act, gate)
    else:
        dg = torch.ops.aten.gelu_backward(d_act, gate, approximate="tanh" if act == "gelu_tanh" else "none")
    return dg, dout * _act_torch(gate, act)


act_and_mul_train_fwd = kernel_op(
    "act_and_mul_train_fwd", _act_fwd_triton, _act_fwd_torch, lambda gate, *_: torch.empty_like(gate),
    doc='act(gate) * up; ``act`` one of "silu", "gelu" (erf), "gelu_tanh".',
)


act_and_mul_train_bwd = kernel_op(
    "act_and_mul_train_bwd", _act_bwd_triton, _act_bwd_torch,
    lambda dout, gate, up, *_: (torch.empty_like(gate), torch.empty_like(up)),
    doc="(d gate, d up) from the upstream gradient and the saved inputs.",
)


class ActAndMulTrainFunction(torch.autograd.Function):
    """Saves gate and up only; the backward recomputes the activation."""

    @staticmethod
    def forward(ctx, gate, up, act):
        ctx.save_for_backward(gate, up)
        ctx.act = act
        return torch.ops.tokenfab.act_and_mul_train_fwd(gate, up, act)

    @staticmethod
    def backward(ctx, dout):
        gate, up = ctx.saved_tensors
        dg, du = torch.ops.tokenfab.act_and_mul_train_bwd(dout, gate, up, ctx.act)
        return dg, du, None


def _check(gate: torch.Tensor, up: torch.Tensor) -> None:
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must match")


def silu_and_mul_train(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up with gradients for both (SwiGLU)."""
    _check(gate, up)
    return ActAndMulTrainFunction.apply(gate, up, "silu")


def gelu_and_mul_train(gate: torch.Tensor, up: torch.Tensor, approximate: str = "tanh") -> torch.Tensor:
    """gelu(gate) * up with gradients for both (GeGLU); ``approximate`` "tanh" or "none" (erf)."""
    if approximate not in ("tanh", "none"):
        raise ValueError(f"gelu approximate must be 'tanh' or 'none', not {approximate!r}")
    _check(gate, up)
    return ActAndMulTrainFunction.apply(gate, up, "gelu_tanh" if approximate == "tanh" else "gelu")
