"""The gated delta rule (Gated DeltaNet) in Triton: chunked prefill over a flat varlen batch and the one-step
recurrent decode, both on a pool of per-sequence state slots. The math, the layouts and the references:
``gated_delta_ref.py``.

Prefill (``gated_delta_prefill``), chunks of 64 tokens, two launches:

1. state pass, one program per (sequence, value head, block of BV value columns): walks its sequence's chunks in
   order holding the state block [Dk, BV] in registers (float32); per chunk it solves the intra-chunk system
   (forward substitution, 64 row steps on a [64, 64] tile), writes the chunk's starting state and its corrected
   values V' to workspaces, and moves the state on; the final state goes back to the slot. The programs of one
   head's value blocks each redo the chunk's solve (Dv / BV = 4 times at Dv = 128).
2. output pass, one program per (chunk of the batch, value head, value block), all independent:
   ``O = exp(G) q S_chunk + lower(q k^T * D) V'``.

Products (``tl.dot``): float32 inputs multiply exactly (ieee), in the rearranged passes of ``gated_delta_fp32.py``
(slices of Dk, the chunk's system solved on V' row by row: the exact products as FMAs fit sm_90's registers);
16-bit inputs multiply 16-bit tiles (the normalised q and k, the state, the inverse, V'; as fla's kernels do) into
float32 accumulators, and the workspaces hold the 16-bit values the output pass multiplies (so splitting changes
no result). Workspace: a [chunks, Hv, Dk, Dv] state per chunk and a [T, Hv, Dv] V' (for 8192 tokens of
Qwen3-Next: 128 x 32 x 128 x 128 bf16 = 128 MiB, plus 64 MiB).
Decode (``gated_delta_decode``): one program per (row, value head, value block) updates its state block once.
"""

from __future__ import annotations

import torch

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels._launch import check_device, dot_precision, next_pow2
import triton
import triton.language as tl
# isort: on

from tokenfab.kernels._dispatch import checked, kernel_op
from tokenfab.kernels.gated_delta_fp32 import _gdn_fp32_output_kernel, _gdn_fp32_state_kernel, prefill_config_fp32
from tokenfab.kernels.gated_delta_ref import CHUNK, L2NORM_EPS, gated_delta_decode_ref, gated_delta_prefill_ref


@triton.jit
def _load_qk(ptr, tok, row_ok, head, dk, st, sh, scale, L2NORM: tl.constexpr, BK: tl.constexpr):
    """Rows ``tok`` of head ``head`` as float32 [BT, BK] (masked rows and columns 0), L2-normalised, times scale."""
    cols = tl.arange(0, BK)
    m = row_ok[:, None] & (cols < dk)[None, :]
    x = tl.load(ptr + tok[:, None] * st + head * sh + cols[None, :], mask=m, other=0.0).to(tl.float32)
    if L2NORM:
        x = x * (1.0 / tl.sqrt(tl.sum(x * x, axis=1) + 1e-6))[:, None]
    return x * scale


@triton.jit
def _gdn_chunk_state_kernel(
    k_ptr, v_ptr, g_ptr, b_ptr, s_ptr, h_ptr, vn_ptr, cu_ptr, slot_ptr, init_ptr, coff_ptr,
    group, dk, dv,
    skt, skh, svt, svh, sgt, sgh, sbt, sbh, ss0, ss1, ss2, sh0, sh1, sh2, snt, snh,
    HAS_INIT: tl.constexpr, L2NORM: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Pass 1, program (value block, value head, sequence): the sequence's chunks in order (gated_delta_ref's
    chunk form), writing each chunk's starting state to ``h`` and its corrected values V' to ``vn`` (both in the
    dtype the output pass multiplies them in), the final state to the slot. Rows past the sequence's end load
    k = v = 0, g = beta = 0: they change nothing."""
    pid_v = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2)
    slot = tl.load(slot_ptr + n).to(tl.int64)
    if slot < 0:
        return
    bos = tl.load(cu_ptr + n).to(tl.int64)
    seq_len = (tl.load(cu_ptr + n + 1) - bos).to(tl.int32)
    chunk0 = tl.load(coff_ptr + n).to(tl.int64)
    hk = h // group
    rk = tl.arange(0, BK)
    cv = pid_v * BV + tl.arange(0, BV)
    vmask = cv < dv
    rt = tl.arange(0, BT)
    strict = rt[:, None] > rt[None, :]
    s_blk = s_ptr + slot * ss0 + h * ss1 + rk[:, None] * ss2 + cv[None, :]
    smask = (rk < dk)[:, None] & vmask[None, :]
    state = tl.zeros((BK, BV), dtype=tl.float32)
    start = True
    if HAS_INIT:
        start = tl.load(init_ptr + n) != 0
    if start:
        state = tl.load(s_blk, mask=smask, other=0.0)
    for c in range(0, tl.cdiv(seq_len, BT)):
        rows = c * BT + rt
        row_ok = rows < seq_len
        tok = bos + rows
        tl.store(h_ptr + (chunk0 + c) * sh0 + h * sh1 + rk[:, None] * sh2 + cv[None, :],
                 state.to(h_ptr.dtype.element_ty), mask=smask)
        k = _load_qk(k_ptr, tok, row_ok, hk, dk, skt, skh, 1.0, L2NORM, BK).to(k_ptr.dtype.element_ty)
        gl = tl.load(g_ptr + tok * sgt + h * sgh, mask=row_ok, other=0.0).to(tl.float32)
        beta = tl.load(b_ptr + tok * sbt + h * sbh, mask=row_ok, other=0.0).to(tl.float32)
        gc = tl.cumsum(gl, axis=0)
        g_last = tl.sum(tl.where(rt == BT - 1, gc, 0.0), axis=0)
        # A = strictly_lower((beta k) k^T * D); T = (I + A)^-1 row by row: row i of T - I is
        # -A[i] + sum_j (-A[i, j]) (T - I)[j] (rows j < i already replaced). Row scalings are applied to the
        # narrow side of each product, so no scaled copy of a [BT, BK] tile stays live.
        a = tl.dot(k, tl.trans(k), input_precision=DOT_PREC) * beta[:, None]
        t = -tl.where(strict, a * tl.exp(tl.where(strict, gc[:, None] - gc[None, :], 0.0)), 0.0)
        for i in range(1, BT):
            sel = (rt == i)[:, None]
            row = tl.sum(tl.where(sel, t, 0.0), axis=0)
            row = row + tl.sum(row[:, None] * t, axis=0)
            t = tl.where(sel, row[None, :], t)
        t = t + tl.where(rt[:, None] == rt[None, :], 1.0, 0.0)
        v = tl.load(v_ptr + tok[:, None] * svt + h * svh + cv[None, :], mask=row_ok[:, None] & vmask[None, :],
                    other=0.0).to(tl.float32)
        # V' = T (beta v) - T (beta exp(G) k) S = T (beta v - beta exp(G) (k S))
        ks = tl.dot(k, state.to(k.dtype), input_precision=DOT_PREC)
        v_new = tl.dot(t.to(k.dtype), ((v - tl.exp(gc)[:, None] * ks) * beta[:, None]).to(k.dtype),
                       input_precision=DOT_PREC)
        tl.store(vn_ptr + tok[:, None] * snt + h * snh + cv[None, :], v_new.to(vn_ptr.dtype.element_ty),
                 mask=row_ok[:, None] & vmask[None, :])
        v_dec = v_new * tl.exp(g_last - gc)[:, None]
        state = state * tl.exp(g_last) + tl.dot(tl.trans(k), v_dec.to(k.dtype), input_precision=DOT_PREC)
    tl.store(s_blk, state, mask=smask)


@triton.jit
def _gdn_chunk_output_kernel(
    q_ptr, k_ptr, g_ptr, o_ptr, h_ptr, vn_ptr, cu_ptr, slot_ptr, coff_ptr, cseq_ptr,
    scale, group, dk, dv,
    sqt, sqh, skt, skh, sgt, sgh, sot, soh, sh0, sh1, sh2, snt, snh,
    L2NORM: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr, DOT_PREC: tl.constexpr,
):
    """Pass 2, program (value block, value head, chunk of the batch), all independent:
    O = (exp(G) q) S_chunk + (lower(q k^T * D)) V'."""
    pid_v = tl.program_id(0)
    h = tl.program_id(1)
    chunk = tl.program_id(2).to(tl.int64)
    n = tl.load(cseq_ptr + chunk)
    if tl.load(slot_ptr + n) < 0:
        return
    bos = tl.load(cu_ptr + n).to(tl.int64)
    seq_len = (tl.load(cu_ptr + n + 1) - bos).to(tl.int32)
    c = (chunk - tl.load(coff_ptr + n)).to(tl.int32)
    hk = h // group
    rt = tl.arange(0, BT)
    rk = tl.arange(0, BK)
    cv = pid_v * BV + tl.arange(0, BV)
    vmask = cv < dv
    rows = c * BT + rt
    row_ok = rows < seq_len
    tok = bos + rows
    q = _load_qk(q_ptr, tok, row_ok, hk, dk, sqt, sqh, scale, L2NORM, BK).to(k_ptr.dtype.element_ty)
    k = _load_qk(k_ptr, tok, row_ok, hk, dk, skt, skh, 1.0, L2NORM, BK).to(k_ptr.dtype.element_ty)
    gc = tl.cumsum(tl.load(g_ptr + tok * sgt + h * sgh, mask=row_ok, other=0.0).to(tl.float32), axis=0)
    lower = rt[:, None] >= rt[None, :]
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PREC)
    qk = tl.where(lower, qk * tl.exp(tl.where(lower, gc[:, None] - gc[None, :], 0.0)), 0.0)
    vmask2 = row_ok[:, None] & vmask[None, :]
    v_new = tl.load(vn_ptr + tok[:, None] * snt + h * snh + cv[None, :], mask=vmask2, other=0.0)
    s = tl.load(h_ptr + chunk * sh0 + h * sh1 + rk[:, None] * sh2 + cv[None, :],
                mask=(rk < dk)[:, None] & vmask[None, :], other=0.0)
    o = tl.dot(q, s, input_precision=DOT_PREC) * tl.exp(gc)[:, None]
    o = o + tl.dot(qk.to(v_new.dtype), v_new, input_precision=DOT_PREC)
    tl.store(o_ptr + tok[:, None] * sot + h * soh + cv[None, :], o.to(o_ptr.dtype.element_ty), mask=vmask2)


@triton.jit
def _gdn_decode_kernel(
    q_ptr, k_ptr, v_ptr, g_ptr, b_ptr, o_ptr, s_ptr, slot_ptr,
    scale, group, dk, dv,
    sqt, sqh, skt, skh, svt, svh, sgt, sgh, sbt, sbh, sot, soh, ss0, ss1, ss2,
    L2NORM: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
):
    """Program (value block, value head, row): one token's decay, delta-rule write and read on its state block."""
    pid_v = tl.program_id(0)
    h = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    cv = pid_v * BV + tl.arange(0, BV)
    vmask = cv < dv
    if slot < 0:  # a padding row: output zero, no state touched
        tl.store(o_ptr + b * sot + h * soh + cv, tl.zeros((BV,), dtype=tl.float32).to(o_ptr.dtype.element_ty),
                 mask=vmask)
        return
    hk = h // group
    rk = tl.arange(0, BK)
    kmask = rk < dk
    q = tl.load(q_ptr + b * sqt + hk * sqh + rk, mask=kmask, other=0.0).to(tl.float32)
    k = tl.load(k_ptr + b * skt + hk * skh + rk, mask=kmask, other=0.0).to(tl.float32)
    if L2NORM:
        q = q * (1.0 / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6))
        k = k * (1.0 / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6))
    q = q * scale
    v = tl.load(v_ptr + b * svt + h * svh + cv, mask=vmask, other=0.0).to(tl.float32)
    gl = tl.load(g_ptr + b * sgt + h * sgh).to(tl.float32)
    beta = tl.load(b_ptr + b * sbt + h * sbh).to(tl.float32)
    s_blk = s_ptr + slot * ss0 + h * ss1 + rk[:, None] * ss2 + cv[None, :]
    smask = kmask[:, None] & vmask[None, :]
    state = tl.load(s_blk, mask=smask, other=0.0) * tl.exp(gl)
    pred = tl.sum(state * k[:, None], axis=0)
    state = state + k[:, None] * ((v - pred) * beta)[None, :]
    o = tl.sum(state * q[:, None], axis=0)
    tl.store(o_ptr + b * sot + h * soh + cv, o.to(o_ptr.dtype.element_ty), mask=vmask)
    tl.store(s_blk, state, mask=smask)


def prefill_config(dk: int, dv: int) -> dict:
    """Launch configurations of the prefill's two passes (also used by the compile test)."""
    bk = next_pow2(max(dk, 16))
    bv = next_pow2(max(dv, 16))
    return dict(state=dict(BT=CHUNK, BK=bk, BV=min(32, bv), num_warps=8 if bk >= 128 else 4, num_stages=1),
                output=dict(BT=CHUNK, BK=bk, BV=min(64, bv), num_warps=4, num_stages=2))


def decode_config(dk: int, dv: int) -> dict:
    """Launch configuration of the decode kernel (also used by the compile test)."""
    bk = next_pow2(dk)
    return dict(BK=bk, BV=min(next_pow2(dv), max(16, 4096 // bk)), num_warps=4)


def _check(q, k, v, g, beta, state, slot_ids, rows: int, op: str) -> None:
    if q.dim() != 3 or k.shape != q.shape or v.dim() != 3 or v.shape[0] != q.shape[0]:
        raise ValueError(f"{op}: q, k must be [T, Hk, Dk] and v [T, Hv, Dv], got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)}")
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    if hv % hk:
        raise ValueError(f"{op}: value heads ({hv}) must be a multiple of key heads ({hk})")
    if g.shape != (t, hv) or beta.shape != (t, hv):
        raise ValueError(f"{op}: g and beta must be [T, Hv] = {(t, hv)}, got {tuple(g.shape)}, {tuple(beta.shape)}")
    if state.dim() != 4 or tuple(state.shape[1:]) != (hv, dk, dv) or state.dtype != torch.float32:
        raise ValueError(f"{op}: state must be float32 [num_slots, {hv}, {dk}, {dv}], got {state.dtype} "
                         f"{tuple(state.shape)}")
    if slot_ids.shape != (rows,):
        raise ValueError(f"{op}: slot_ids must have one entry per sequence ({rows}), got {tuple(slot_ids.shape)}")


def _check_prefill(q, k, v, g, beta, cu_seqlens, state, slot_ids, has_state, scale, use_qk_l2norm) -> None:
    _check(q, k, v, g, beta, state, slot_ids, cu_seqlens.numel() - 1, "gated_delta_prefill")
    if has_state is not None and has_state.shape != slot_ids.shape:
        raise ValueError(f"gated_delta_prefill: has_state must be [N], got {tuple(has_state.shape)}")


def _check_decode(q, k, v, g, beta, state, slot_ids, scale, use_qk_l2norm) -> None:
    _check(q, k, v, g, beta, state, slot_ids, q.shape[0], "gated_delta_decode")


def _lastdim(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _gated_delta_prefill_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    cu_seqlens: torch.Tensor, state: torch.Tensor, slot_ids: torch.Tensor, has_state: torch.Tensor | None,
    scale: float, use_qk_l2norm: bool,
) -> torch.Tensor:
    check_device(v)
    _check_prefill(q, k, v, g, beta, cu_seqlens, state, slot_ids, has_state, scale, use_qk_l2norm)
    t, hk, dk = q.shape
    hv, dv = v.shape[1:]
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    n = slot_ids.numel()
    if t == 0 or n == 0:
        return out
    q, k, v, st = _lastdim(q), _lastdim(k), _lastdim(v), state
    if st.stride(-1) != 1:
        raise ValueError("gated_delta_prefill: the state's last dim must be contiguous")
    cfg = prefill_config(dk, dv)
    init = has_state.to(torch.int32) if has_state is not None else slot_ids  # (bool masks trip the interpreter)
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
    n_chunks = (lens + CHUNK - 1) // CHUNK
    chunk_off = torch.zeros(n + 1, dtype=torch.int32, device=v.device)
    chunk_off[1:] = n_chunks.cumsum(0)
    total = int(chunk_off[-1])
    chunk_seq = torch.repeat_interleave(torch.arange(n, dtype=torch.int32, device=v.device), n_chunks)
    # each chunk's starting state and V', in the dtype the output pass multiplies them in (16-bit or float32)
    work = k.dtype if k.dtype in (torch.float16, torch.bfloat16) else torch.float32
    h = torch.empty(total, hv, dk, dv, dtype=work, device=v.device)
    vn = torch.empty(t, hv, dv, dtype=work, device=v.device)
    prec = dot_precision(v.dtype)
    fp32 = work == torch.float32  # exact products: the float32 variant of both passes (gated_delta_fp32.py)
    if fp32:
        cfg = prefill_config_fp32(dk, dv)
    c1 = cfg["state"]
    state_kernel = _gdn_fp32_state_kernel if fp32 else _gdn_chunk_state_kernel
    state_kernel[(triton.cdiv(dv, c1["BV"]), hv, n)](
        k, v, g, beta, st, h, vn, cu_seqlens, slot_ids, init, chunk_off,
        hv // hk, dk, dv,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), g.stride(0), g.stride(1), beta.stride(0), beta.stride(1),
        st.stride(0), st.stride(1), st.stride(2), h.stride(0), h.stride(1), h.stride(2), vn.stride(0), vn.stride(1),
        HAS_INIT=has_state is not None, L2NORM=use_qk_l2norm, **({} if fp32 else dict(DOT_PREC=prec)), **c1,
    )
    c2 = cfg["output"]
    output_kernel = _gdn_fp32_output_kernel if fp32 else _gdn_chunk_output_kernel
    output_kernel[(triton.cdiv(dv, c2["BV"]), hv, total)](
        q, k, g, out, h, vn, cu_seqlens, slot_ids, chunk_off, chunk_seq,
        scale, hv // hk, dk, dv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), g.stride(0), g.stride(1), out.stride(0), out.stride(1),
        h.stride(0), h.stride(1), h.stride(2), vn.stride(0), vn.stride(1),
        L2NORM=use_qk_l2norm, **({} if fp32 else dict(DOT_PREC=prec)), **c2,
    )
    return out


def _gated_delta_decode_triton(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor, slot_ids: torch.Tensor, scale: float, use_qk_l2norm: bool,
) -> torch.Tensor:
    check_device(v)
    _check_decode(q, k, v, g, beta, state, slot_ids, scale, use_qk_l2norm)
    b, hk, dk = q.shape
    hv, dv = v.shape[1:]
    out = torch.empty(v.shape, dtype=v.dtype, device=v.device)
    if b == 0:
        return out
    q, k, v = _lastdim(q), _lastdim(k), _lastdim(v)
    if state.stride(-1) != 1:
        raise ValueError("gated_delta_decode: the state's last dim must be contiguous")
    cfg = decode_config(dk, dv)
    grid = (triton.cdiv(dv, cfg["BV"]), hv, b)
    _gdn_decode_kernel[grid](
        q, k, v, g, beta, out, state, slot_ids,
        scale, hv // hk, dk, dv,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        g.stride(0), g.stride(1), beta.stride(0), beta.stride(1), out.stride(0), out.stride(1),
        state.stride(0), state.stride(1), state.stride(2),
        L2NORM=use_qk_l2norm, **cfg,
    )
    return out


assert L2NORM_EPS == 1e-6  # the kernels write the model's epsilon as a literal

#: the references with the launchers' argument checks (the ops' CPU path)
prefill_reference = checked(gated_delta_prefill_ref, _check_prefill)
decode_reference = checked(gated_delta_decode_ref, _check_decode)

gated_delta_prefill = kernel_op(
    "gated_delta_prefill", _gated_delta_prefill_triton, prefill_reference,
    lambda q, k, v, *_: torch.empty_like(v), signature=gated_delta_prefill_ref, mutates_args=("state",),
)

gated_delta_decode = kernel_op(
    "gated_delta_decode", _gated_delta_decode_triton, decode_reference,
    lambda q, k, v, *_: torch.empty_like(v), signature=gated_delta_decode_ref, mutates_args=("state",),
)
