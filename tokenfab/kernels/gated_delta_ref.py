"""The gated delta rule (Gated DeltaNet, the linear-attention layers of Qwen3-Next / Qwen3.5) in plain PyTorch:
the references of the Triton kernels in ``gated_delta.py``.

Per value head, the recurrent state ``S`` is a [Dk, Dv] matrix (float32). One token with query ``q``, key ``k``
(both [Dk]), value ``v`` ([Dv]), log decay ``g`` (a scalar <= 0) and write strength ``beta`` (in (0, 1)) does

    S = exp(g) * S                      decay
    S = S + k (beta * (v - k^T S))      delta rule: move S's prediction for k towards v
    o = q^T S                           read ([Dv])

with q and k L2-normalised (``use_qk_l2norm``: ``x / sqrt(sum(x^2) + 1e-6)``, as in the model) and q scaled by
``scale`` (the model: Dk^-0.5). Grouped heads: value head ``h`` reads query/key head ``h // (Hv // Hk)``.

The model's gating (``gdn_gating_ref``): ``g = -exp(A_log) * softplus(a + dt_bias)``, ``beta = sigmoid(b)``.

Two equivalent forms: the token recurrence (``recurrent_ref``: the definition, and the decode step) and the
chunkwise-parallel form over chunks of ``CHUNK`` tokens (``chunk_ref``: what the prefill kernel computes). Within a
chunk, with cumulative log decays ``G_i = g_1 + ... + g_i`` and ``D_ij = exp(G_i - G_j)`` for ``i >= j``:

    A = strictly_lower((beta k) k^T * D)        the chunk's delta-rule corrections to each other
    T = (I + A)^-1                              (unit lower triangular, by forward substitution)
    U = T (beta v),  W = T (beta exp(G) k)
    V' = U - W S                                what each token writes, less what the old state predicts
    O = (exp(G) q) S + (lower(q k^T * D)) V'
    S = exp(G_C) S + (exp(G_C - G) k)^T V'

The batch layout is the engine's flat varlen batch: tokens of all sequences concatenated ([T, heads, dim]),
``cu_seqlens`` [N + 1] their boundaries; each sequence's state lives in a slot of a state pool
[num_slots, Hv, Dk, Dv] (float32), ``slot_ids`` [N] picks it; a sequence with ``has_state[n]`` false (or without
``has_state``) starts from zeros, whatever the slot holds. The final state is written back to the slot (in place).
A slot id of -1 marks a padding row: nothing is read or written, its output is zero.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # tokens per chunk of the chunkwise-parallel form
L2NORM_EPS = 1e-6


def l2norm_ref(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, in float32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gdn_gating_ref(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's gates from its projections a, b ([T, Hv]): log decay ``g = -exp(A_log) * softplus(a + dt_bias)``
    (float32) and ``beta = sigmoid(b)`` (b's dtype)."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, b.sigmoid()


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm):
    """float32 [H, L, D] tensors with the key heads repeated to the value heads; q normalised and scaled."""
    group = v.shape[1] // k.shape[1]
    q, k = (x.float().repeat_interleave(group, dim=1) for x in (q, k))
    if use_qk_l2norm:
        q, k = l2norm_ref(q), l2norm_ref(k)
    q = q * scale
    return (x.transpose(0, 1) for x in (q, k, v.float(), g.float(), beta.float()))


def recurrent_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                  state: torch.Tensor, scale: float, use_qk_l2norm: bool = True
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence, token by token. q, k: [L, Hk, Dk]; v: [L, Hv, Dv]; g, beta: [L, Hv]; state: [Hv, Dk, Dv].
    Returns (o [L, Hv, Dv] float32, the final state float32)."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    s = state.float().clone()
    out = torch.empty_like(v)
    for t in range(v.shape[1]):
        s = s * g[:, t].exp()[:, None, None]
        pred = torch.einsum("hk,hkv->hv", k[:, t], s)
        s = s + k[:, t, :, None] * ((v[:, t] - pred) * beta[:, t, None])[:, None, :]
        out[:, t] = torch.einsum("hk,hkv->hv", q[:, t], s)
    return out.transpose(0, 1), s


def _unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """(I + a)^-1 for strictly lower triangular ``a`` [..., C, C]."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device)
    return torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)


def chunk_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
              state: torch.Tensor, scale: float, use_qk_l2norm: bool = True, chunk: int = CHUNK
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in the chunkwise-parallel form (module docstring); same arguments and results as
    ``recurrent_ref``."""
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm)
    n = v.shape[1]
    pad = (-n) % chunk
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))  # padded tokens: k = v = 0, g = beta = 0
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    h = v.shape[0]
    q, k, v = (x.view(h, -1, chunk, x.shape[-1]) for x in (q, k, v))
    g, beta = (x.view(h, -1, chunk) for x in (g, beta))
    cum = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=v.device).tril()
    decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    kb = k * beta[..., None]
    a = ((kb @ k.transpose(-1, -2)) * decay).tril(-1)
    t_inv = _unit_lower_inverse(a)
    u = t_inv @ (v * beta[..., None])
    w = t_inv @ (kb * cum.exp()[..., None])
    attn = (q @ k.transpose(-1, -2)) * decay
    q_dec = q * cum.exp()[..., None]
    last = cum[..., -1:]
    k_dec = k * (last - cum).exp()[..., None]
    s = state.float().clone()
    out = torch.empty_like(v)
    for c in range(v.shape[1]):
        v_new = u[:, c] - w[:, c] @ s
        out[:, c] = q_dec[:, c] @ s + attn[:, c] @ v_new
        s = s * last[:, c].exp()[:, :, None] + k_dec[:, c].transpose(-1, -2) @ v_new
    return out.reshape(h, -1, v.shape[-1])[:, :n].transpose(0, 1), s


def _initial(state: torch.Tensor, slot: int, has_state: torch.Tensor | None, n: int) -> torch.Tensor:
    if has_state is None or bool(has_state[n]):
        return state[slot]
    return torch.zeros_like(state[slot])


def gated_delta_prefill_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    cu_seqlens: torch.Tensor,
    state: torch.Tensor,
    slot_ids: torch.Tensor,
    has_state: torch.Tensor | None,
    scale: float,
    use_qk_l2norm: bool,
) -> torch.Tensor:
    """A flat varlen batch (module docstring). q, k: [T, Hk, Dk]; v: [T, Hv, Dv]; g, beta: [T, Hv];
    cu_seqlens: [N + 1]; state: [num_slots, Hv, Dk, Dv] float32, updated in place; slot_ids: [N];
    has_state: [N] bool or None. Returns o [T, Hv, Dv] in v's dtype."""
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    bounds = cu_seqlens.tolist()
    for n, slot in enumerate(slot_ids.tolist()):
        lo, hi = bounds[n], bounds[n + 1]
        if slot < 0:
            continue
        s0 = _initial(state, slot, has_state, n)
        o, s = chunk_ref(q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], s0, scale, use_qk_l2norm)
        out[lo:hi] = o.to(v.dtype)
        state[slot] = s.to(state.dtype)
    return out


def gated_delta_decode_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slot_ids: torch.Tensor,
    scale: float,
    use_qk_l2norm: bool,
) -> torch.Tensor:
    """One token for each of B sequences: q, k: [B, Hk, Dk]; v: [B, Hv, Dv]; g, beta: [B, Hv]; state
    [num_slots, Hv, Dk, Dv] (updated in place at ``slot_ids`` [B]; -1: a padding row, skipped, output zero).
    Returns o [B, Hv, Dv] in v's dtype."""
    out = torch.zeros(v.shape, dtype=v.dtype, device=v.device)
    rows = (slot_ids >= 0).nonzero().flatten()
    if rows.numel() == 0:
        return out
    slots = slot_ids[rows].long()
    qf, kf, vf, gf, bf = _prepare(q[rows], k[rows], v[rows], g[rows], beta[rows], scale, use_qk_l2norm)
    s = state[slots].float() * gf.transpose(0, 1).exp()[..., None, None]  # [B', Hv, Dk, Dv]
    kf, qf, vf, bf = (x.transpose(0, 1) for x in (kf, qf, vf, bf))
    pred = torch.einsum("bhk,bhkv->bhv", kf, s)
    s = s + kf[..., None] * ((vf - pred) * bf[..., None])[..., None, :]
    out[rows] = torch.einsum("bhk,bhkv->bhv", qf, s).to(v.dtype)
    state[slots] = s.to(state.dtype)
    return out
