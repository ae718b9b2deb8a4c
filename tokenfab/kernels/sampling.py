"""Batched token sampling with per-row parameters and counter-based randomness.

Randomness comes from a 32-bit integer hash of (row seed, vocabulary index), so a row's
draw depends only on its own seed: same seed, same token, whatever else is in the batch,
on any device, in the reference and in the Triton kernel alike. The engine derives each
step's row seed from the request's seed and the number of tokens generated so far.

Sampling is the exponential race: token = argmax_i p_i / E_i with E_i = -log(u_i), which
draws from p without a cumulative sum. A temperature of 0 means greedy (argmax of the raw
logits, the first index on ties). Otherwise the filters are vLLM's, in vLLM's order:

1. temperature: p = softmax(logits / T);
2. top-k (k <= 0 or k >= V: off): keep the k most likely tokens;
3. top-p (p >= 1: off), on the distribution that top-k left, renormalised: keep the smallest
   set of most likely tokens whose mass reaches top_p times the top-k set's mass, i.e. a token
   stays while the mass of the tokens more likely than it is below that (always at least one);
4. min-p (0: off): keep the tokens whose probability is at least min_p times the largest
   (relative, so renormalising changes nothing);

then sample from the kept tokens, renormalised. Each filter keeps a set {p >= threshold}, so
tokens of exactly equal probability at a boundary are kept or dropped together (vLLM's top-k
does the same; its top-p breaks such ties by sort position, which is arbitrary).
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

_M32 = 0xFFFFFFFF


def hash_uniform(seeds: torch.Tensor, n: int) -> torch.Tensor:
    """[B] int64 seeds -> [B, n] float32 uniforms in (0, 1), one per vocabulary index."""
    idx = torch.arange(n, device=seeds.device, dtype=torch.int64)
    x = ((seeds[:, None] & _M32) ^ ((idx[None, :] * 0x9E3779B9) & _M32)) & _M32
    x = ((x ^ (x >> 16)) * 0x85EBCA6B) & _M32
    x = ((x ^ (x >> 13)) * 0xC2B2AE35) & _M32
    x = x ^ (x >> 16)
    return ((x >> 8).float() + 0.5) * (1.0 / (1 << 24))


def filter_probs_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
) -> torch.Tensor:
    """Probabilities after temperature, top-k (<=0: off), top-p (>=1: off), min-p (0: off).

    The filters' semantics are the module docstring's. Rows with temperature 0 are computed at
    temperature 1 (the caller takes argmax).
    """
    v = logits.shape[-1]
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    probs = torch.softmax(logits.float() / t[:, None].float(), dim=-1)
    sorted_p, order = probs.sort(dim=-1, descending=True)
    # where each token's group of equal probabilities starts in the sorted row (= how many are larger)
    larger = v - torch.searchsorted(sorted_p.flip(-1).contiguous(), sorted_p, right=True)
    # top-k: the k largest, and every token tied with the k-th
    k = torch.where(top_k > 0, top_k.clamp(max=v), torch.full_like(top_k, v)).long()
    keep = sorted_p >= sorted_p.gather(-1, (k - 1)[:, None])
    # top-p on the top-k distribution renormalised: keep a token while the mass strictly above it
    # is below top_p * (mass of the top-k set)
    kept_p = sorted_p * keep
    k_on = ((top_k > 0) & (top_k < v))[:, None]
    mass_k = torch.where(k_on, kept_p.sum(-1, keepdim=True), torch.ones_like(kept_p[:, :1]))
    mass_above = (kept_p.cumsum(-1) - kept_p).gather(-1, larger)
    keep &= (mass_above < top_p[:, None].float() * mass_k) | (top_p[:, None] >= 1.0) | (larger == 0)
    # min-p: at least min_p times the largest probability (the most likely tokens always stay)
    keep &= sorted_p >= (min_p[:, None].float().clamp(0.0, 1.0) * sorted_p[:, :1])
    sorted_p = sorted_p * keep
    out = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
    return out / out.sum(-1, keepdim=True)


def sample_ref(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
) -> torch.Tensor:
    """logits [B, V]; per-row temperature/top_p/min_p float, top_k int, seeds int64 -> [B] int64."""
    if logits.shape[0] == 0:
        return torch.empty(0, dtype=torch.int64, device=logits.device)
    probs = filter_probs_ref(logits, temperature, top_k, top_p, min_p)
    u = hash_uniform(seeds, logits.shape[-1])
    race = probs / (-torch.log(u))
    sampled = race.argmax(-1)
    greedy = logits.argmax(-1)
    return torch.where(temperature > 0, sampled, greedy)


@triton.jit
def _hash_uniform_tl(seed, idx):
    """The reference's hash_uniform for one row: seed uint32 scalar, idx int32 vector."""
    x = seed ^ (idx.to(tl.uint32) * 0x9E3779B9)
    x = (x ^ (x >> 16)) * 0x85EBCA6B
    x = (x ^ (x >> 13)) * 0xC2B2AE35
    x = x ^ (x >> 16)
    return ((x >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)


@triton.jit
def _search_tau(base, vocab, inv_t, m, inv_z, lo, hi, k_eff, p_lim, NUM_T: tl.constexpr, BLOCK_S: tl.constexpr):
    """The smallest fp32 tau in (lo, hi] (int32 bit patterns of non-negative floats) with
    count(p > tau) < k_eff and mass(p > tau) < p_lim, by a NUM_T-way bisection (each pass over
    the row narrows the interval NUM_T + 1 fold). Invariant: Q(lo) false, Q(hi) true."""
    ti = tl.arange(0, NUM_T)
    so = tl.arange(0, BLOCK_S)
    while hi - lo > 1:
        step = tl.cdiv(hi - lo, NUM_T + 1)
        cand = tl.minimum(lo + (ti + 1) * step, hi)
        thr = cand.to(tl.float32, bitcast=True)
        cnts = tl.zeros((NUM_T,), tl.int32)
        masses = tl.zeros((NUM_T,), tl.float32)
        for v0 in range(0, vocab, BLOCK_S):
            idx = v0 + so
            y = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32) * inv_t
            p = tl.exp(y - m) * inv_z
            gt = p[None, :] > thr[:, None]
            cnts += tl.sum(gt.to(tl.int32), 1)
            masses += tl.sum(tl.where(gt, p[None, :], 0.0), 1)
        q = (cnts < k_eff) & (masses < p_lim)
        n_false = tl.sum((q == 0).to(tl.int32), 0)
        new_lo = tl.sum(tl.where(ti == n_false - 1, cand, 0), 0)
        new_hi = tl.sum(tl.where(ti == n_false, cand, 0), 0)
        lo = tl.where(n_false > 0, new_lo, lo)
        hi = tl.where(n_false < NUM_T, new_hi, hi)
    return hi


@triton.jit
def _sample_kernel(
    logits_ptr, temp_ptr, topk_ptr, topp_ptr, minp_ptr, seed_ptr, out_ptr,
    vocab, stride,
    BLOCK_V: tl.constexpr,
    NUM_T: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """One program per row. See the module docstring for the sampling rule.

    Greedy rows: one pass (argmax, first index on ties). Other rows: pass 1 computes the
    softmax max and normaliser and the exponential race's winner w over all tokens
    (argmax of y - log E, y = logit / T). The filters keep {p >= tau} for a threshold tau, so
    w is the answer whenever it passes them: pass 2 counts the tokens above p_w and their
    mass. Top-p needs the mass S_k of the top-k set; when bounds on it do not decide, the k-th
    largest probability is searched for (``_search_tau``) and S_k summed. Only when w fails is
    tau searched for, followed by one race over the kept tokens. No sort anywhere.
    """
    row = tl.program_id(0)
    base = logits_ptr + row.to(tl.int64) * stride
    t = tl.load(temp_ptr + row).to(tl.float32)
    offs = tl.arange(0, BLOCK_V)
    if t <= 0.0:
        best = float("-inf")
        best_i = 0
        for v0 in range(0, vocab, BLOCK_V):
            x = tl.load(base + v0 + offs, mask=v0 + offs < vocab, other=float("-inf")).to(tl.float32)
            cm = tl.max(x, 0)
            ci = tl.argmax(x, 0, tie_break_left=True) + v0
            up = cm > best
            best_i = tl.where(up, ci, best_i)
            best = tl.where(up, cm, best)
        tok = best_i
    else:
        seed = tl.load(seed_ptr + row).to(tl.uint32)
        # reciprocals, so that the passes below multiply: each division in a loop is a call to
        # a slow-path subroutine, and enough of them need a stack frame on sm_90
        inv_t = 1.0 / t
        # pass 1: max, normaliser, race winner
        m = float("-inf")
        z = 0.0
        win_key = float("-inf")
        win = 0
        for v0 in range(0, vocab, BLOCK_V):
            idx = v0 + offs
            y = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32) * inv_t
            m_new = tl.maximum(m, tl.max(y, 0))
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
            z = z * tl.exp(m - m_ref) + tl.sum(tl.exp(y - m_ref), 0)
            m = m_new
            key = y - tl.log(-tl.log(_hash_uniform_tl(seed, idx)))
            ck = tl.max(key, 0)
            ci = tl.argmax(key, 0, tie_break_left=True) + v0
            up = ck > win_key
            win = tl.where(up, ci, win)
            win_key = tl.where(up, ck, win_key)
        tok = win
        inv_z = 1.0 / z

        top_k = tl.load(topk_ptr + row).to(tl.int32)
        top_p = tl.load(topp_ptr + row).to(tl.float32)
        min_p = tl.load(minp_ptr + row).to(tl.float32)
        k_eff = tl.where((top_k <= 0) | (top_k >= vocab), vocab, top_k)
        k_eff = tl.where(top_p <= 0.0, 1, k_eff)  # top_p 0 keeps only the most likely tokens
        p_lim = tl.where((top_p < 1.0) & (top_p > 0.0), top_p, 2.0)  # 2.0: never binds
        p_max = tl.exp(m - m) * inv_z
        tau_min = tl.minimum(tl.maximum(min_p, 0.0) * p_max, p_max)
        if (k_eff < vocab) | (p_lim < 2.0) | (tau_min > 0.0):
            y_w = tl.load(base + win).to(tl.float32) * inv_t
            p_w = tl.exp(y_w - m) * inv_z
            w_bits = p_w.to(tl.int32, bitcast=True)
            # pass 2: the count and mass of the tokens above the winner, and the mass from it up
            cnt = 0
            mass = 0.0
            mass_ge = 0.0
            for v0 in range(0, vocab, BLOCK_V):
                idx = v0 + offs
                y = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32) * inv_t
                p = tl.exp(y - m) * inv_z
                gt = p > p_w
                cnt += tl.sum(gt.to(tl.int32), 0)
                mass += tl.sum(tl.where(gt, p, 0.0), 0)
                mass_ge += tl.sum(tl.where(p >= p_w, p, 0.0), 0)
            # top-p is relative to the top-k set's mass S_k (1 without top-k). If w is in the top
            # k, S_k >= mass_ge, which may already decide that w passes both; otherwise phase 0
            # finds the k-th largest probability and sums S_k. Phase 1 finds the kept threshold
            # when w fails (when it passes, its search interval is empty). One call site for both
            # searches keeps the kernel small.
            in_k = cnt < k_eff
            need_k = (k_eff < vocab) & (p_lim < 2.0) & ((cnt >= k_eff) | (mass >= p_lim * mass_ge))
            p_max_bits = p_max.to(tl.int32, bitcast=True)
            tau = p_w
            phase = tl.where(need_k, 0, 1)
            while phase < 2:
                first = phase == 0
                q_w = (cnt < k_eff) & (mass < p_lim)
                lo = tl.where(first, tl.where(in_k, -1, w_bits), tl.where(q_w, w_bits - 1, w_bits))
                hi = tl.where((first & in_k) | ((phase == 1) & q_w), w_bits, p_max_bits)
                lim = tl.where(first, 2.0, p_lim)
                found = _search_tau(base, vocab, inv_t, m, inv_z, lo, hi, k_eff, lim, NUM_T, BLOCK_S)
                found = found.to(tl.float32, bitcast=True)
                if first:
                    s_k = 0.0
                    for v0 in range(0, vocab, BLOCK_V):
                        idx = v0 + offs
                        y = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32) * inv_t
                        p = tl.exp(y - m) * inv_z
                        s_k += tl.sum(tl.where(p >= found, p, 0.0), 0)
                    p_lim = p_lim * s_k
                else:
                    tau = tl.maximum(found, tau_min)
                phase += 1
            if tau > p_w:
                # the winner was filtered out: race again over the kept tokens {p >= tau}
                win_key = float("-inf")
                win = 0
                for v0 in range(0, vocab, BLOCK_V):
                    idx = v0 + offs
                    y = tl.load(base + idx, mask=idx < vocab, other=float("-inf")).to(tl.float32) * inv_t
                    p = tl.exp(y - m) * inv_z
                    key = y - tl.log(-tl.log(_hash_uniform_tl(seed, idx)))
                    key = tl.where(p >= tau, key, float("-inf"))
                    ck = tl.max(key, 0)
                    ci = tl.argmax(key, 0, tie_break_left=True) + v0
                    up = ck > win_key
                    win = tl.where(up, ci, win)
                    win_key = tl.where(up, ck, win_key)
                tok = win
    tl.store(out_ptr + row, tok.to(tl.int64))


def sample_config(vocab: int) -> dict:
    """Launch configuration (also used by the compile test)."""
    block_v = min(next_pow2(vocab), 2048)
    return dict(BLOCK_V=block_v, NUM_T=16, BLOCK_S=min(block_v, 256), num_warps=8 if block_v >= 2048 else 4)


def _sample_triton(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_k: torch.Tensor,
    top_p: torch.Tensor,
    min_p: torch.Tensor,
    seeds: torch.Tensor,
) -> torch.Tensor:
    check_device(logits)
    b, v = logits.shape
    out = torch.empty(b, dtype=torch.int64, device=logits.device)
    if b == 0:
        return out
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    cfg = sample_config(v)
    _sample_kernel[(b,)](
        logits, temperature.contiguous(), top_k.contiguous(), top_p.contiguous(), min_p.contiguous(),
        seeds.contiguous(), out, v, logits.stride(0), **cfg,
    )
    return out


sample = kernel_op(
    "sample", _sample_triton, sample_ref, lambda logits, *_: logits.new_empty(logits.shape[0], dtype=torch.int64)
)
