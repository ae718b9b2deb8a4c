"""The gated delta rule's chunked prefill for float32 inputs: the two passes of ``gated_delta.py`` rearranged so
that exact (ieee) float32 products fit Hopper's registers.

Why a float32 variant: float32 ``tl.dot`` at ieee precision has no tensor-core form; Triton lowers it to
unrolled FMAs, each thread holding its output rows and columns of both operands over the whole reduction
dimension. At the 16-bit kernels' tiles (reductions of Dk = 128 and of the 64 chunk rows, the state and the
intra-chunk inverse in registers) that spilled 6.5 KB (state pass) and 15 KB (output pass) on sm_90. Here:

- every product over Dk runs in slices of ``BKC`` columns, both operands loaded from memory: q and k from the
  inputs (the L2 norm is a per-row scale, applied to the products: ``(r_i k_i) . (r_j k_j) = r_i r_j (k_i .
  k_j)``), the chunk's starting state from the ``h`` workspace the state pass has just written (a CTA barrier
  between the store and the loads);
- the intra-chunk system ``(I + A) V' = X`` is solved on V' directly, row by row (no [BT, BT] inverse, so no
  product over the chunk rows with a register operand);
- the state update ``S += (exp(G_C - G) k)^T V'`` runs over the chunk's rows in slices of ``BJ``, V' read back
  from its workspace; the output pass's ``lower(q k^T * D) V'`` adds one key row's column of the masked scores
  at a time (``BT`` rank-one updates, V' rows from the workspace).

Layouts, arguments and results are those of ``gated_delta.py``'s kernels (the launcher there picks these for
float32); the math is ``gated_delta_ref.chunk_ref``'s.
"""

from __future__ import annotations

# isort: off
# _launch picks Triton's interpreter on machines without a GPU; it must run before triton loads
from tokenfab.kernels import _launch  # noqa: F401
import triton
import triton.language as tl
# isort: on


@triton.jit
def _row_pick(x, rt, cols):
    """x [BT] at the positions ``cols`` [BJ] (a register gather as a masked sum)."""
    return tl.sum(tl.where(rt[:, None] == cols[None, :], x[:, None], 0.0), axis=0)


@triton.jit
def _gdn_fp32_state_kernel(
    k_ptr,
    v_ptr,
    g_ptr,
    b_ptr,
    s_ptr,
    h_ptr,
    vn_ptr,
    cu_ptr,
    slot_ptr,
    init_ptr,
    coff_ptr,
    group,
    dk,
    dv,
    skt,
    skh,
    svt,
    svh,
    sgt,
    sgh,
    sbt,
    sbh,
    ss0,
    ss1,
    ss2,
    sh0,
    sh1,
    sh2,
    snt,
    snh,
    HAS_INIT: tl.constexpr,
    L2NORM: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BKC: tl.constexpr,
    BJ: tl.constexpr,
):
    """Pass 1, program (value block, value head, sequence): as ``_gdn_chunk_state_kernel``."""
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
    rkc = tl.arange(0, BKC)
    rj = tl.arange(0, BJ)
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
        h_chunk = h_ptr + (chunk0 + c) * sh0 + h * sh1
        tl.store(h_chunk + rk[:, None] * sh2 + cv[None, :], state, mask=smask)
        tl.debug_barrier()  # the slices of the state below are read back by other threads
        gl = tl.load(g_ptr + tok * sgt + h * sgh, mask=row_ok, other=0.0).to(tl.float32)
        beta = tl.load(b_ptr + tok * sbt + h * sbh, mask=row_ok, other=0.0).to(tl.float32)
        gc = tl.cumsum(gl, axis=0)
        g_last = tl.sum(tl.where(rt == BT - 1, gc, 0.0), axis=0)
        # k k^T and k S over slices of Dk (unnormalised k; the row norms scale the products afterwards)
        sumsq = tl.zeros((BT,), dtype=tl.float32)
        a = tl.zeros((BT, BT), dtype=tl.float32)
        ks = tl.zeros((BT, BV), dtype=tl.float32)
        for d0 in range(0, BK, BKC):
            kd = d0 + rkc
            kc = tl.load(
                k_ptr + tok[:, None] * skt + hk * skh + kd[None, :],
                mask=row_ok[:, None] & (kd < dk)[None, :],
                other=0.0,
            ).to(tl.float32)
            sc = tl.load(h_chunk + kd[:, None] * sh2 + cv[None, :], mask=(kd < dk)[:, None] & vmask[None, :], other=0.0)
            sumsq += tl.sum(kc * kc, axis=1)
            a += tl.dot(kc, tl.trans(kc), input_precision="ieee")
            ks += tl.dot(kc, sc, input_precision="ieee")
        if L2NORM:
            rn = 1.0 / tl.sqrt(sumsq + 1e-6)
            a = a * (rn[:, None] * rn[None, :])
            ks = ks * rn[:, None]
        a = tl.where(strict, a * beta[:, None] * tl.exp(tl.where(strict, gc[:, None] - gc[None, :], 0.0)), 0.0)
        v = tl.load(
            v_ptr + tok[:, None] * svt + h * svh + cv[None, :], mask=row_ok[:, None] & vmask[None, :], other=0.0
        ).to(tl.float32)
        # (I + A) V' = X, X = beta (v - exp(G) k S): row i of V' is X_i - sum_{j < i} A_ij V'_j
        vn = (v - tl.exp(gc)[:, None] * ks) * beta[:, None]
        for i in range(1, BT):
            sel = rt == i
            a_row = tl.sum(tl.where(sel[:, None], a, 0.0), axis=0)
            corr = tl.sum(a_row[:, None] * vn, axis=0)
            vn = tl.where(sel[:, None], vn - corr[None, :], vn)
        tl.store(vn_ptr + tok[:, None] * snt + h * snh + cv[None, :], vn, mask=row_ok[:, None] & vmask[None, :])
        tl.debug_barrier()  # V' rows are read back in slices below
        # S = exp(G_C) S + sum over row slices of (exp(G_C - G_j) k_j)^T V'_j
        state = state * tl.exp(g_last)
        for j0 in range(0, BT, BJ):
            jr = j0 + rj
            j_ok = (c * BT + jr) < seq_len
            kj = tl.load(
                k_ptr + (bos + c * BT + jr)[:, None] * skt + hk * skh + rk[None, :],
                mask=j_ok[:, None] & (rk < dk)[None, :],
                other=0.0,
            ).to(tl.float32)
            scale_j = tl.exp(g_last - _row_pick(gc, rt, jr))
            if L2NORM:
                scale_j = scale_j / tl.sqrt(tl.sum(kj * kj, axis=1) + 1e-6)
            vj = tl.load(
                vn_ptr + (bos + c * BT + jr)[:, None] * snt + h * snh + cv[None, :],
                mask=j_ok[:, None] & vmask[None, :],
                other=0.0,
            )
            state += tl.dot(tl.trans(kj * scale_j[:, None]), vj, input_precision="ieee")
    tl.store(s_blk, state, mask=smask)


@triton.jit
def _gdn_fp32_output_kernel(
    q_ptr,
    k_ptr,
    g_ptr,
    o_ptr,
    h_ptr,
    vn_ptr,
    cu_ptr,
    slot_ptr,
    coff_ptr,
    cseq_ptr,
    scale,
    group,
    dk,
    dv,
    sqt,
    sqh,
    skt,
    skh,
    sgt,
    sgh,
    sot,
    soh,
    sh0,
    sh1,
    sh2,
    snt,
    snh,
    L2NORM: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    BV: tl.constexpr,
    BKC: tl.constexpr,
):
    """Pass 2, program (value block, value head, chunk of the batch): as ``_gdn_chunk_output_kernel``."""
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
    rkc = tl.arange(0, BKC)
    cv = pid_v * BV + tl.arange(0, BV)
    vmask = cv < dv
    rows = c * BT + rt
    row_ok = rows < seq_len
    tok = bos + rows
    gc = tl.cumsum(tl.load(g_ptr + tok * sgt + h * sgh, mask=row_ok, other=0.0).to(tl.float32), axis=0)
    h_chunk = h_ptr + chunk * sh0 + h * sh1
    # q k^T and q S over slices of Dk (unnormalised q, k; their row norms and the scale applied afterwards)
    sq = tl.zeros((BT,), dtype=tl.float32)
    sk = tl.zeros((BT,), dtype=tl.float32)
    qk = tl.zeros((BT, BT), dtype=tl.float32)
    o = tl.zeros((BT, BV), dtype=tl.float32)
    for d0 in range(0, BK, BKC):
        kd = d0 + rkc
        m = row_ok[:, None] & (kd < dk)[None, :]
        qc = tl.load(q_ptr + tok[:, None] * sqt + hk * sqh + kd[None, :], mask=m, other=0.0).to(tl.float32)
        kc = tl.load(k_ptr + tok[:, None] * skt + hk * skh + kd[None, :], mask=m, other=0.0).to(tl.float32)
        sc = tl.load(h_chunk + kd[:, None] * sh2 + cv[None, :], mask=(kd < dk)[:, None] & vmask[None, :], other=0.0)
        sq += tl.sum(qc * qc, axis=1)
        sk += tl.sum(kc * kc, axis=1)
        qk += tl.dot(qc, tl.trans(kc), input_precision="ieee")
        o += tl.dot(qc, sc, input_precision="ieee")
    rq = tl.zeros((BT,), dtype=tl.float32) + scale
    rk = tl.zeros((BT,), dtype=tl.float32) + 1.0
    if L2NORM:
        rq = rq / tl.sqrt(sq + 1e-6)
        rk = rk / tl.sqrt(sk + 1e-6)
    lower = rt[:, None] >= rt[None, :]
    qk = tl.where(
        lower, qk * (rq[:, None] * rk[None, :]) * tl.exp(tl.where(lower, gc[:, None] - gc[None, :], 0.0)), 0.0
    )
    o = o * (rq * tl.exp(gc))[:, None]
    # + lower(q k^T * D) V': one key row j at a time (its column of the scores times V'_j)
    vbase = vn_ptr + bos * snt + h * snh + cv
    for j in range(0, tl.minimum(BT, seq_len - c * BT)):
        col = tl.sum(tl.where(rt[None, :] == j, qk, 0.0), axis=1)
        vj = tl.load(vbase + (c * BT + j) * snt, mask=vmask, other=0.0)
        o += col[:, None] * vj[None, :]
    tl.store(
        o_ptr + tok[:, None] * sot + h * soh + cv[None, :],
        o.to(o_ptr.dtype.element_ty),
        mask=row_ok[:, None] & vmask[None, :],
    )


def prefill_config_fp32(dk: int, dv: int) -> dict:
    """Launch configurations of the float32 passes (also used by the compile test): Dk in slices of 16, the state
    update over 16 rows at a time."""
    bk = triton.next_power_of_2(max(dk, 16))
    bv = triton.next_power_of_2(max(dv, 16))
    return dict(
        state=dict(BT=64, BK=bk, BV=min(32, bv), BKC=16, BJ=16, num_warps=8, num_stages=1),
        output=dict(BT=64, BK=bk, BV=min(32, bv), BKC=16, num_warps=4, num_stages=1),
    )
