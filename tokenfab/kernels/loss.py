"""Fused linear cross-entropy (FLCE): the LM head's GEMM and the cross-entropy loss, chunked over
tokens so the ``[tokens, vocab]`` logits never exist in full (the Liger-Kernel algorithm).

Per chunk of C token rows: ``logits = h_c @ W^T (+ b)`` (a ``[C, V]`` buffer in the input dtype),
then one pass over each row computes the loss and overwrites the logits *in place* with
d(loss)/d(logits), then ``grad_h_c = dlogits @ W`` and ``grad_W += dlogits^T @ h_c``. The gradient
is thus computed in the forward; the backward only scales the stored gradients by the upstream
gradient. Memory: one ``[C, V]`` chunk instead of ``[T, V]`` logits plus their fp32 copy and grad.

The per-row loss, with lse = logsumexp(x), eps = label_smoothing, V the vocabulary:
    loss = lse - (1 - eps) * x[y] - eps / V * sum_j x[j]  (+ z_loss_scale * lse^2)
    dloss/dx_j = p_j * (1 + 2 * z_loss_scale * lse) - eps / V - (1 - eps) * [j == y],  p = softmax(x)
Rows whose label is ``ignore_index`` give 0 and a zero gradient. ``reduction="mean"`` divides by the
number of non-ignored rows (0 when every row is ignored, not NaN: a packed batch whose window holds
no trained token must not poison a training step). Per-row work runs in fp32 whatever the dtype.

Dispatch (``kernels/_dispatch.py``): "triton" -> the Triton row kernel (online softmax over the
vocabulary in blocks, in place); otherwise the same chunked algorithm in torch (``ce_chunk_ref``),
so the memory saving is real on CPU too. ``fused_linear_cross_entropy_ref`` (full logits +
``F.cross_entropy``) is the test oracle. The GEMMs are torch's (cuBLAS / oneDNN) on every path.
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

from tokenfab.kernels._dispatch import use_triton

REDUCTIONS = ("mean", "sum")


# ----------------------------------------------------------------------------- the row kernel


@triton.jit
def _ce_row_kernel(
    logits_ptr, labels_ptr, loss_ptr, lse_ptr, scale_ptr,
    vocab, stride_row, ignore_index, smoothing, z_scale,
    HAS_SMOOTHING: tl.constexpr,
    HAS_Z: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    """Program r: loss[r], lse[r], and logits[r, :] overwritten with scale * d loss[r] / d logits[r, :]."""
    row = tl.program_id(0).to(tl.int64)
    ptr = logits_ptr + row * stride_row
    label = tl.load(labels_ptr + row)
    offs = tl.arange(0, BLOCK_V)
    if label == ignore_index:
        for v0 in range(0, vocab, BLOCK_V):
            tl.store(ptr + v0 + offs, tl.zeros([BLOCK_V], dtype=tl.float32).to(logits_ptr.dtype.element_ty),
                     mask=v0 + offs < vocab)
        tl.store(loss_ptr + row, 0.0)
        tl.store(lse_ptr + row, 0.0)
        return
    # pass 1: online max and sum of exponentials (and the sum of logits for label smoothing)
    m = float("-inf")
    d = 0.0
    sum_x = 0.0
    for v0 in range(0, vocab, BLOCK_V):
        mask = v0 + offs < vocab
        x = tl.load(ptr + v0 + offs, mask=mask, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        if HAS_SMOOTHING:
            sum_x += tl.sum(tl.where(mask, x, 0.0), axis=0)
    lse = m + tl.log(d)
    x_y = tl.load(ptr + label).to(tl.float32)
    loss = lse - (1.0 - smoothing) * x_y
    if HAS_SMOOTHING:
        loss -= smoothing / vocab * sum_x
    p_scale = 1.0
    if HAS_Z:
        loss += z_scale * lse * lse
        p_scale = 1.0 + 2.0 * z_scale * lse
    tl.store(loss_ptr + row, loss)
    tl.store(lse_ptr + row, lse)
    scale = tl.load(scale_ptr)
    # pass 2: the gradient, in place
    for v0 in range(0, vocab, BLOCK_V):
        mask = v0 + offs < vocab
        x = tl.load(ptr + v0 + offs, mask=mask, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) * p_scale
        if HAS_SMOOTHING:
            g -= smoothing / vocab
        g = tl.where(v0 + offs == label, g - (1.0 - smoothing), g) * scale
        tl.store(ptr + v0 + offs, g.to(logits_ptr.dtype.element_ty), mask=mask)


def ce_config(vocab: int) -> dict:
    """One program per row, the vocabulary in blocks of up to 4096 (16 KB of fp32 per block)."""
    block = min(next_pow2(vocab), 4096)
    return dict(BLOCK_V=block, num_warps=8 if block >= 2048 else 4)


def _ce_chunk_triton(logits: torch.Tensor, labels: torch.Tensor, grad_scale: torch.Tensor, ignore_index: int,
                     label_smoothing: float, z_loss_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """In place: ``logits [C, V]`` (rows contiguous) -> ``grad_scale`` (an fp32 tensor of one element:
    no host sync) * d loss / d logits; returns the unscaled (loss [C], lse [C]) in fp32."""
    check_device(logits)
    c, v = logits.shape
    loss = torch.empty(c, dtype=torch.float32, device=logits.device)
    lse = torch.empty_like(loss)
    if c == 0:
        return loss, lse
    assert logits.stride(1) == 1, "the CE kernel needs rows with unit stride"
    _ce_row_kernel[(c,)](
        logits, labels, loss, lse, grad_scale, v, logits.stride(0), int(ignore_index), float(label_smoothing),
        float(z_loss_scale), HAS_SMOOTHING=label_smoothing > 0, HAS_Z=z_loss_scale > 0, **ce_config(v),
    )
    return loss, lse


def ce_chunk_ref(logits: torch.Tensor, labels: torch.Tensor, grad_scale: torch.Tensor, ignore_index: int,
                 label_smoothing: float, z_loss_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The row kernel in torch (same signature, in place): the CPU path of the chunked algorithm.

    Works on one fp32 ``[C, V]`` buffer (the logits themselves when they are fp32)."""
    v = logits.shape[1]
    x = logits.float()
    valid = labels != ignore_index
    safe = torch.where(valid, labels, 0).long()[:, None]
    loss = -(1.0 - label_smoothing) * x.gather(1, safe).squeeze(1)
    if label_smoothing > 0:
        loss = loss - label_smoothing / v * x.sum(dim=-1)
    # one exp pass: p = exp(x - max) / sum, lse = max + log(sum)
    m = x.amax(dim=-1, keepdim=True)
    e = x.sub_(m).exp_()
    s = e.sum(dim=-1, keepdim=True)
    lse = (m + s.log()).squeeze(1)
    loss = loss + lse
    # per-row factor of the softmax term: validity, the reduction's scale, the z-loss's (1 + 2 z lse)
    row = valid.to(torch.float32) * grad_scale.reshape(1)
    if z_loss_scale > 0:
        loss = loss + z_loss_scale * lse * lse
        e.mul_((row * (1.0 + 2.0 * z_loss_scale * lse))[:, None] / s)
    else:
        e.mul_(row[:, None] / s)
    if label_smoothing > 0:
        e.sub_((label_smoothing / v) * row[:, None])
    e.scatter_add_(1, safe, (label_smoothing - 1.0) * row[:, None])
    if e.data_ptr() != logits.data_ptr():
        logits.copy_(e)
    zero = torch.zeros((), dtype=loss.dtype, device=loss.device)
    return torch.where(valid, loss, zero), torch.where(valid, lse, zero)


# ----------------------------------------------------------------------------- the chunked driver


def default_chunk_size(num_tokens: int, hidden: int, vocab: int) -> int:
    """Rows per chunk: T / ceil(V / H) rounded up to a power of two (the logits chunk is about as
    large as the hidden states; Liger's rule), at least 256 rows so each GEMM stays efficient (on
    CPU at 2048 tokens x 49152 vocabulary, 256 rows ran ~20% faster than 64 for 62 vs 26 MiB peak)."""
    rows = next_pow2(triton.cdiv(num_tokens, triton.cdiv(vocab, max(hidden, 1))))
    return max(1, min(num_tokens, max(rows, 256)))


def _check(hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss_scale, reduction, chunk_size):
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"expected hidden [T, H] and weight [V, H], got {tuple(hidden.shape)} and "
                         f"{tuple(weight.shape)}")
    if labels.shape != hidden.shape[:1]:
        raise ValueError(f"labels must be [{hidden.shape[0]}], got {tuple(labels.shape)}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be integers, got {labels.dtype}")
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise ValueError(f"hidden, weight (and bias) must share a dtype: {hidden.dtype}, {weight.dtype}")
    if not hidden.device == weight.device == labels.device or (bias is not None and bias.device != hidden.device):
        raise ValueError(f"hidden, weight, labels (and bias) must be on one device: {hidden.device}, "
                         f"{weight.device}, {labels.device}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"reduction must be one of {REDUCTIONS}, not {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if z_loss_scale < 0:
        raise ValueError(f"z_loss_scale must be >= 0, got {z_loss_scale}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if labels.device.type == "cpu" and labels.numel():  # free on CPU; on a GPU it would be a sync
        bad = (labels != ignore_index) & ((labels < 0) | (labels >= weight.shape[0]))
        if bool(bad.any()):
            raise ValueError(f"label {int(labels[bad][0])} is outside the vocabulary [0, {weight.shape[0]}) "
                             f"and is not ignore_index ({ignore_index})")


def flce_forward(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None,
                 ignore_index: int, label_smoothing: float, z_loss_scale: float, reduction: str,
                 chunk_size: int | None, need_grads: tuple[bool, bool, bool]):
    """(loss fp32 scalar, grad_hidden, grad_weight, grad_bias): the gradients of ``loss`` (already
    divided by the token count for "mean"), or None where ``need_grads`` says no."""
    t, h = hidden.shape
    v = weight.shape[0]
    dev = hidden.device
    need_h, need_w, need_b = need_grads
    need_b = need_b and bias is not None
    chunk = chunk_size or default_chunk_size(t, h, v)
    triton_path = use_triton(hidden)
    ce = _ce_chunk_triton if triton_path else ce_chunk_ref
    labels = labels.contiguous()
    grad_h = hidden.new_empty(hidden.shape) if need_h else None  # contiguous whatever hidden's strides
    # grad_W accumulates over chunks in the weight's dtype, like Liger: addmm computes each chunk's
    # product plus the running sum in fp32 and rounds once; an fp32 buffer for a 16-bit head would
    # cost 2 bytes more per weight (2 GB more for Llama-3-8B's head) plus a temporary per chunk
    grad_w = torch.zeros(v, h, dtype=weight.dtype, device=dev) if need_w else None
    grad_b = torch.zeros(v, dtype=torch.float32, device=dev) if need_b else None
    loss_rows = torch.empty(t, dtype=torch.float32, device=dev)
    if reduction == "mean":
        # a device tensor: no host sync; 1 / max(n, 1) so an all-ignored batch gives 0, not NaN
        scale = (labels != ignore_index).sum().clamp_(min=1).to(torch.float32).reciprocal_().reshape(1)
    else:
        scale = torch.ones(1, dtype=torch.float32, device=dev)
    wt = weight.t()
    for s in range(0, t, chunk):
        e = min(s + chunk, t)
        h_c = hidden[s:e]
        logits = torch.addmm(bias, h_c, wt) if bias is not None else torch.mm(h_c, wt)
        loss_rows[s:e] = ce(logits, labels[s:e], scale, ignore_index, label_smoothing, z_loss_scale)[0]
        dlogits = logits  # overwritten in place
        if need_h:
            torch.mm(dlogits, weight, out=grad_h[s:e])
        if need_w:
            grad_w.addmm_(dlogits.t(), h_c)
        if need_b:
            grad_b.add_(dlogits.sum(dim=0, dtype=torch.float32))
        del logits, dlogits
    loss = loss_rows.sum() * scale[0]
    if grad_b is not None:
        grad_b = grad_b.to(bias.dtype)
    return loss, grad_h, grad_w, grad_b


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, labels, ignore_index, label_smoothing, z_loss_scale, reduction,
                chunk_size):
        need = (ctx.needs_input_grad[0], ctx.needs_input_grad[1], ctx.needs_input_grad[2])
        loss, gh, gw, gb = flce_forward(hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss_scale,
                                        reduction, chunk_size, need)
        ctx.grads = (gh, gw, gb)
        return loss

    @staticmethod
    def backward(ctx, grad_out):
        grads = ctx.grads
        if grads is None:
            raise RuntimeError("fused_linear_cross_entropy: its gradients were already used (one backward per call)")
        ctx.grads = None  # the engine then owns the only reference: AccumulateGrad takes them without a copy
        # identity fast path on CPU (free to check there; on a GPU the check would be a sync and
        # the multiply costs little next to the GEMMs). In place: these tensors are ours alone now;
        # the fp32 0-dim factor does not promote a bf16 gradient (computed in fp32, rounded once).
        if not (grad_out.device.type == "cpu" and float(grad_out) == 1.0):
            for g in grads:
                if g is not None:
                    g.mul_(grad_out)
        return (*grads, None, None, None, None, None, None)


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden [T, H] @ weight[V, H]^T (+ bias)`` against ``labels [T]`` (fp32 scalar).

    Leading dimensions of ``hidden`` / ``labels`` are flattened. The gradients for hidden, weight
    and bias (those that require grad) are computed in this call, chunk by chunk; with grad mode
    off (or nothing requiring grad) only the loss is computed. Under autocast the head runs in the
    autocast dtype (as ``F.linear`` would).
    """
    if hidden.dim() > 2:
        hidden = hidden.reshape(-1, hidden.shape[-1])
        labels = labels.reshape(-1)
    dev_type = hidden.device.type
    if torch.is_autocast_enabled(dev_type):
        # what autocast does to an LM head: run it in the autocast dtype (the casts are differentiable,
        # so the gradients reach fp32 master weights); the chunks then run with autocast off
        dt = torch.get_autocast_dtype(dev_type)
        hidden, weight = hidden.to(dt), weight.to(dt)
        bias = None if bias is None else bias.to(dt)
    _check(hidden, weight, labels, bias, ignore_index, label_smoothing, z_loss_scale, reduction, chunk_size)
    args = (ignore_index, float(label_smoothing), float(z_loss_scale), reduction, chunk_size)
    needs = [t is not None and t.requires_grad for t in (hidden, weight, bias)]
    with torch.autocast(dev_type, enabled=False):
        if not (torch.is_grad_enabled() and any(needs)):
            return flce_forward(hidden, weight, labels, bias, *args, (False, False, False))[0]
        return _FusedLinearCrossEntropy.apply(hidden, weight, bias, labels, *args)


def fused_linear_cross_entropy_ref(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    label_smoothing: float = 0.0,
    z_loss_scale: float = 0.0,
    reduction: str = "mean",
    chunk_size: int | None = None,
) -> torch.Tensor:
    """The oracle: full ``[T, V]`` logits (input dtype, as the HF LM head), fp32 ``F.cross_entropy``
    plus the z-loss; differentiable by autograd. ``chunk_size`` is ignored."""
    del chunk_size
    if hidden.dim() > 2:
        hidden = hidden.reshape(-1, hidden.shape[-1])
        labels = labels.reshape(-1)
    logits = F.linear(hidden, weight, bias).float()
    valid = labels != ignore_index
    loss = F.cross_entropy(logits, labels.long(), ignore_index=ignore_index, label_smoothing=label_smoothing,
                           reduction="sum")
    if z_loss_scale > 0:
        loss = loss + z_loss_scale * (torch.logsumexp(logits, dim=-1)[valid] ** 2).sum()
    if reduction == "mean":
        loss = loss / valid.sum().clamp(min=1)
    return loss
