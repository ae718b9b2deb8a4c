"""The short causal depthwise conv1d of Gated DeltaNet layers (Qwen3-Next / Qwen3.5: width 4, SiLU), with its
rolling state per sequence slot: varlen prefill and the one-step decode update.

Channel ``d`` of token ``t`` is ``act(bias[d] + sum_j weight[d, j] * x[t - (W - 1) + j, d])``, where the inputs
before a sequence's first token come from its conv state (the sequence's last W - 1 inputs so far; zeros for a
sequence without state) and ``act`` is SiLU or nothing. The state pool ``conv_state`` is [num_slots, D, W - 1]
(column W - 2 the newest input; any strides), ``slot_ids`` [N] picks each sequence's slot, and after the call the
slot holds the sequence's last W - 1 inputs (a short sequence keeps the older ones from its state). A slot id of
-1 marks a padding sequence: no state read or written, output zero. Transformers keeps W columns (the oldest
unused); ours is that state less its first column. Math in float32, output in x's dtype, state in its own.

Triton: prefill runs the conv over (sequence, token block, channel block) programs, then a second launch rolls
the states (so no program overwrites a state another one still reads); decode is one program per (row, channel
block) doing both.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import check_device, next_pow2
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels._dispatch import checked, kernel_op


def _conv_one(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, past: torch.Tensor, silu: bool
              ) -> torch.Tensor:
    """x [L, D] after ``past`` [D, W - 1] (float32), float32 out [L, D]."""
    xs = torch.cat((past.float(), x.float().t()), dim=1)  # [D, W - 1 + L]
    out = F.conv1d(xs[None], weight.float()[:, None, :], None if bias is None else bias.float(),
                   groups=weight.shape[0])[0].t()
    return F.silu(out) if silu else out


def _past(conv_state: torch.Tensor, slot: int, has: bool) -> torch.Tensor:
    return conv_state[slot].float() if has else torch.zeros(conv_state.shape[1:], dtype=torch.float32,
                                                            device=conv_state.device)


def causal_conv1d_prefill_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor,
    slot_ids: torch.Tensor,
    has_state: torch.Tensor | None,
    silu: bool,
) -> torch.Tensor:
    """A flat varlen batch: x [T, D]; weight [D, W]; bias [D] or None; cu_seqlens [N + 1]; conv_state
    [num_slots, D, W - 1] (updated in place); slot_ids [N]; has_state [N] bool or None (None: every sequence
    continues its state). Returns out [T, D] in x's dtype."""
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    bounds = cu_seqlens.tolist()
    width = weight.shape[1]
    for n, slot in enumerate(slot_ids.tolist()):
        lo, hi = bounds[n], bounds[n + 1]
        if slot < 0:
            continue
        past = _past(conv_state, slot, has_state is None or bool(has_state[n]))
        if hi > lo:
            out[lo:hi] = _conv_one(x[lo:hi], weight, bias, past, silu).to(x.dtype)
        conv_state[slot] = torch.cat((past, x[lo:hi].float().t()), dim=1)[:, -(width - 1):].to(conv_state.dtype)
    return out


def causal_conv1d_update_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    conv_state: torch.Tensor,
    slot_ids: torch.Tensor,
    silu: bool,
) -> torch.Tensor:
    """One new token for each of B sequences: x [B, D]; conv_state [num_slots, D, W - 1] (rolled in place at
    ``slot_ids`` [B]; -1: padding row, output zero). Returns out [B, D] in x's dtype."""
    cu = torch.arange(x.shape[0] + 1, dtype=torch.int32)
    return causal_conv1d_prefill_ref(x, weight, bias, cu, conv_state, slot_ids, None, silu)


@triton.jit
def _conv_tile(x_ptr, s_ptr, w_ptr, bias_ptr, bos, rows, seq_len, slot, cols, dim, sxt, ss0, ss1, ss2, use_state,
               HAS_BIAS: tl.constexpr, SILU: tl.constexpr, W: tl.constexpr):
    """float32 outputs [BT, BD] of sequence-relative rows ``rows`` (inputs before row 0 from the state where
    ``use_state``, a boolean per row, else zeros)."""
    cmask = cols < dim
    acc = tl.zeros((rows.shape[0], cols.shape[0]), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    for j in tl.static_range(W):
        src = rows + (j - (W - 1))  # the input row this tap reads
        in_x = (src >= 0) & (src < seq_len)
        xv = tl.load(x_ptr + (bos + src.to(tl.int64))[:, None] * sxt + cols[None, :],
                     mask=in_x[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        in_s = (src < 0) & use_state
        sv = tl.load(s_ptr + slot * ss0 + cols[None, :] * ss1 + (src + (W - 1))[:, None] * ss2,
                     mask=in_s[:, None] & cmask[None, :], other=0.0).to(tl.float32)
        wj = tl.load(w_ptr + cols * W + j, mask=cmask, other=0.0).to(tl.float32)
        acc += (xv + sv) * wj[None, :]
    if SILU:
        acc = acc / (1.0 + tl.exp(-acc))
    return acc


@triton.jit
def _conv_prefill_kernel(
    x_ptr, w_ptr, bias_ptr, o_ptr, s_ptr, cu_ptr, slot_ptr, init_ptr,
    dim, sxt, sot, ss0, ss1, ss2,
    HAS_INIT: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr, W: tl.constexpr,
    BT: tl.constexpr, BD: tl.constexpr,
):
    """Program (channel block, token block, sequence); token blocks past the sequence's end return."""
    pid_d = tl.program_id(0)
    pid_t = tl.program_id(1)
    n = tl.program_id(2)
    bos = tl.load(cu_ptr + n).to(tl.int64)
    seq_len = (tl.load(cu_ptr + n + 1) - bos).to(tl.int32)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    if pid_t * BT >= seq_len or slot < 0:
        return
    rows = pid_t * BT + tl.arange(0, BT)
    # per row (the interpreter cannot mask with a scalar boolean and a block)
    use_state = rows >= 0
    if HAS_INIT:
        use_state = tl.load(init_ptr + n + rows * 0) != 0
    cols = pid_d * BD + tl.arange(0, BD)
    acc = _conv_tile(x_ptr, s_ptr, w_ptr, bias_ptr, bos, rows, seq_len, slot, cols, dim, sxt, ss0, ss1, ss2,
                     use_state, HAS_BIAS, SILU, W)
    m = (rows < seq_len)[:, None] & (cols < dim)[None, :]
    tl.store(o_ptr + (bos + rows.to(tl.int64))[:, None] * sot + cols[None, :], acc.to(o_ptr.dtype.element_ty), mask=m)


@triton.jit
def _conv_state_kernel(
    x_ptr, s_ptr, cu_ptr, slot_ptr, init_ptr,
    dim, sxt, ss0, ss1, ss2,
    HAS_INIT: tl.constexpr, W: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr,
):
    """Program (channel block, sequence): the slot's new state, its sequence's last W - 1 inputs (older ones from
    the old state when the sequence is shorter), all read before any is written."""
    pid_d = tl.program_id(0)
    n = tl.program_id(1)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    if slot < 0:
        return
    bos = tl.load(cu_ptr + n).to(tl.int64)
    seq_len = (tl.load(cu_ptr + n + 1) - bos).to(tl.int32)
    c = tl.arange(0, BS)  # state column
    use_state = c >= 0  # per column (the interpreter cannot mask with a scalar boolean and a block)
    if HAS_INIT:
        use_state = tl.load(init_ptr + n + c * 0) != 0
    cols = pid_d * BD + tl.arange(0, BD)
    cmask = cols < dim
    src = seq_len - (W - 1) + c  # the sequence row it takes
    col_ok = c < W - 1
    xv = tl.load(x_ptr + (bos + src.to(tl.int64))[:, None] * sxt + cols[None, :],
                 mask=(col_ok & (src >= 0))[:, None] & cmask[None, :], other=0.0)
    old = s_ptr + slot * ss0 + cols[None, :] * ss1
    sv = tl.load(old + (src + (W - 1))[:, None] * ss2, mask=(col_ok & (src < 0) & use_state)[:, None] & cmask[None, :],
                 other=0.0)
    new = tl.where((src >= 0)[:, None], xv.to(tl.float32), sv.to(tl.float32))
    tl.debug_barrier()
    tl.store(old + c[:, None] * ss2, new.to(s_ptr.dtype.element_ty), mask=col_ok[:, None] & cmask[None, :])


@triton.jit
def _conv_update_kernel(
    x_ptr, w_ptr, bias_ptr, o_ptr, s_ptr, slot_ptr,
    dim, sxt, sot, ss0, ss1, ss2,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, W: tl.constexpr, BS: tl.constexpr, BD: tl.constexpr,
):
    """Program (channel block, row): the row's output from its state and new input, then the state rolled by one."""
    pid_d = tl.program_id(0)
    b = tl.program_id(1).to(tl.int64)
    cols = pid_d * BD + tl.arange(0, BD)
    cmask = cols < dim
    slot = tl.load(slot_ptr + b).to(tl.int64)
    if slot < 0:
        tl.store(o_ptr + b * sot + cols, tl.zeros((BD,), dtype=tl.float32).to(o_ptr.dtype.element_ty), mask=cmask)
        return
    row = tl.arange(0, 1)
    acc = _conv_tile(x_ptr, s_ptr, w_ptr, bias_ptr, b, row, 1, slot, cols, dim, sxt, ss0, ss1, ss2,
                     row >= 0, HAS_BIAS, SILU, W)
    tl.store(o_ptr + b * sot + cols[None, :], acc.to(o_ptr.dtype.element_ty), mask=cmask[None, :])
    c = tl.arange(0, BS)
    col_ok = c < W - 1
    old = s_ptr + slot * ss0 + cols[None, :] * ss1
    shifted = tl.load(old + (c + 1)[:, None] * ss2, mask=(c < W - 2)[:, None] & cmask[None, :], other=0.0)
    xv = tl.load(x_ptr + b * sxt + cols, mask=cmask, other=0.0).to(s_ptr.dtype.element_ty)
    new = tl.where((c == W - 2)[:, None], xv[None, :], shifted)
    tl.debug_barrier()
    tl.store(old + c[:, None] * ss2, new, mask=col_ok[:, None] & cmask[None, :])


def conv_config(dim: int, width: int) -> dict:
    """Launch configuration (also used by the compile test)."""
    return dict(BT=16, BD=min(128, next_pow2(dim)), BS=next_pow2(max(width - 1, 1)), num_warps=4)


def _check(x, weight, bias, conv_state, slot_ids, rows: int, op: str) -> None:
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[0] != x.shape[1] or weight.shape[1] < 2:
        raise ValueError(f"{op}: x must be [T, D] and weight [D, W] (W >= 2), got {tuple(x.shape)}, "
                         f"{tuple(weight.shape)}")
    d, w = weight.shape
    if conv_state.dim() != 3 or tuple(conv_state.shape[1:]) != (d, w - 1):
        raise ValueError(f"{op}: conv_state must be [num_slots, {d}, {w - 1}], got {tuple(conv_state.shape)}")
    if bias is not None and bias.shape != (d,):
        raise ValueError(f"{op}: bias must be [{d}], got {tuple(bias.shape)}")
    if slot_ids.shape != (rows,):
        raise ValueError(f"{op}: slot_ids must have one entry per sequence ({rows}), got {tuple(slot_ids.shape)}")


def _check_prefill(x, weight, bias, cu_seqlens, conv_state, slot_ids, has_state, silu) -> None:
    _check(x, weight, bias, conv_state, slot_ids, cu_seqlens.numel() - 1, "causal_conv1d_prefill")


def _check_update(x, weight, bias, conv_state, slot_ids, silu) -> None:
    _check(x, weight, bias, conv_state, slot_ids, x.shape[0], "causal_conv1d_update")


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _causal_conv1d_prefill_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, cu_seqlens: torch.Tensor,
    conv_state: torch.Tensor, slot_ids: torch.Tensor, has_state: torch.Tensor | None, silu: bool,
) -> torch.Tensor:
    check_device(x)
    _check_prefill(x, weight, bias, cu_seqlens, conv_state, slot_ids, has_state, silu)
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    n = slot_ids.numel()
    if x.shape[0] == 0 or n == 0:
        return out
    x, w = _rows(x), weight.contiguous()
    d, width = w.shape
    cfg = conv_config(d, width)
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    init = has_state.to(torch.int32) if has_state is not None else slot_ids  # (bool masks trip the interpreter)
    st = conv_state.stride()
    bias_arg = bias if bias is not None else w
    _conv_prefill_kernel[(triton.cdiv(d, cfg["BD"]), triton.cdiv(max_len, cfg["BT"]), n)](
        x, w, bias_arg, out, conv_state, cu_seqlens, slot_ids, init, d, x.stride(0), out.stride(0), *st,
        HAS_INIT=has_state is not None, HAS_BIAS=bias is not None, SILU=silu, W=width,
        BT=cfg["BT"], BD=cfg["BD"], num_warps=cfg["num_warps"],
    )
    _conv_state_kernel[(triton.cdiv(d, cfg["BD"]), n)](
        x, conv_state, cu_seqlens, slot_ids, init, d, x.stride(0), *st,
        HAS_INIT=has_state is not None, W=width, BS=cfg["BS"], BD=cfg["BD"], num_warps=cfg["num_warps"],
    )
    return out


def _causal_conv1d_update_triton(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, conv_state: torch.Tensor,
    slot_ids: torch.Tensor, silu: bool,
) -> torch.Tensor:
    check_device(x)
    _check_update(x, weight, bias, conv_state, slot_ids, silu)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.shape[0] == 0:
        return out
    x, w = _rows(x), weight.contiguous()
    d, width = w.shape
    cfg = conv_config(d, width)
    _conv_update_kernel[(triton.cdiv(d, cfg["BD"]), x.shape[0])](
        x, w, bias if bias is not None else w, out, conv_state, slot_ids, d, x.stride(0), out.stride(0),
        *conv_state.stride(), HAS_BIAS=bias is not None, SILU=silu, W=width, BS=cfg["BS"], BD=cfg["BD"],
        num_warps=cfg["num_warps"],
    )
    return out


#: the references with the launchers' argument checks (the ops' CPU path)
prefill_reference = checked(causal_conv1d_prefill_ref, _check_prefill)
update_reference = checked(causal_conv1d_update_ref, _check_update)

causal_conv1d_prefill = kernel_op(
    "causal_conv1d_prefill", _causal_conv1d_prefill_triton, prefill_reference,
    lambda x, *_: torch.empty_like(x), signature=causal_conv1d_prefill_ref, mutates_args=("conv_state",),
)

causal_conv1d_update = kernel_op(
    "causal_conv1d_update", _causal_conv1d_update_triton, update_reference,
    lambda x, *_: torch.empty_like(x), signature=causal_conv1d_update_ref, mutates_args=("conv_state",),
)
