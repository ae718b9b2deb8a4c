"""Fused linear cross-entropy (kernels/loss.py): the loss and the gradients for hidden, weight and
bias against autograd through the full-logits oracle (``F.cross_entropy`` on ``h @ W^T`` + z-loss),
on the Triton path (the interpreter on CPU) and the chunked torch path, fp32 and bf16."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.tiers import tiered
from tests.kernels.tolerances import assert_train_close, assert_train_close_scaled
from tokenfab.kernels import loss as L

F32, BF16 = torch.float32, torch.bfloat16
IGNORE = -100


PATHS = ["triton", "torch"]


@pytest.fixture(params=PATHS)
def path(request, monkeypatch) -> str:
    """TOKENFAB_KERNELS=triton: the Triton row kernel (interpreter on CPU); torch: the chunked torch path."""
    monkeypatch.setenv("TOKENFAB_KERNELS", request.param)
    return request.param


def _inputs(t, h, v, dtype, device, gen, bias=False, ignore=(), scale=0.3):
    hid = torch.randn(t, h, generator=gen).to(device, dtype).requires_grad_()
    w = (scale * torch.randn(v, h, generator=gen)).to(device, dtype).requires_grad_()
    b = (0.5 * torch.randn(v, generator=gen)).to(device, dtype).requires_grad_() if bias else None
    labels = torch.randint(0, v, (t,), generator=gen)
    for i in ignore:
        labels[i] = IGNORE
    return hid, w, b, labels.to(device)


def _run(fn, hid, w, b, labels, upstream=1.0, **kw):
    for x in (hid, w, b):
        if x is not None:
            x.grad = None
    loss = fn(hid, w, labels, b, **kw)
    (loss * upstream).backward()
    return loss.detach(), [None if x is None or x.grad is None else x.grad.clone() for x in (hid, w, b)]


def _check_against_oracle(hid, w, b, labels, dtype, upstream=1.0, **kw):
    loss, grads = _run(L.fused_linear_cross_entropy, hid, w, b, labels, upstream, **kw)
    loss_ref, grads_ref = _run(L.fused_linear_cross_entropy_ref, hid, w, b, labels, upstream, **kw)
    assert loss.dtype == F32 and loss.dim() == 0
    assert_train_close(loss, loss_ref, F32 if dtype == F32 else BF16)
    for g, g_ref in zip(grads, grads_ref):
        if g_ref is None:
            assert g is None
        else:
            # bf16: grad_W accumulates chunk by chunk in bf16 (as Liger's): each chunk rounds a partial
            # sum, an error the size of the gradient's entries, hence the RMS-scaled tolerance
            assert_train_close_scaled(g, g_ref)


CASES = [
    # t, h, v, chunk_size
    (1, 16, 1000, None),  # one token; V not a multiple of the block
    (37, 32, 1000, 8),  # chunks that do not divide T
    (9, 24, 49152, 4),  # the bundled model's vocabulary at small T (12 blocks of 4096)
    (20, 16, 257, 7),
    (260, 32, 1000, None),  # the default chunk (256 rows, then 4)
]


def _slow_plain(path, t, h, v, chunk, dtype) -> bool:
    """Slow tier: on the Triton path the 260-token case (its default chunk is torch code, fast on the
    torch path; the row kernel is the same at any row count) and the large-vocabulary case (several
    4096-wide vocabulary blocks: test_row_kernel_matches_torch_rows runs them fast, V=5000); one dtype of
    the 37-token case and of the torch path's large vocabulary (both dtypes stay on the one-token and
    the V=257 case)."""
    n = CASES.index((t, h, v, chunk))
    return (path == "triton" and n in (2, 4)) or (dtype == F32 and (n == 2 or (path == "triton" and n == 1)))


@pytest.mark.parametrize("path,t,h,v,chunk,dtype", tiered(
    [(p, *case, dtype) for p in PATHS for case in CASES for dtype in (F32, BF16)], _slow_plain), indirect=["path"])
def test_plain_and_ignore(t, h, v, chunk, dtype, path, device, gen):
    hid, w, b, labels = _inputs(t, h, v, dtype, device, gen, ignore=range(0, t, 3) if t > 1 else ())
    _check_against_oracle(hid, w, b, labels, dtype, chunk_size=chunk)


OPTIONS = [
    dict(label_smoothing=0.1),
    dict(z_loss_scale=1e-2),
    dict(label_smoothing=0.2, z_loss_scale=1e-3, bias=True),
    dict(bias=True, reduction="sum"),
    dict(label_smoothing=0.05, reduction="sum", upstream=2.5),
    dict(label_smoothing=1.0),
]


def _slow_option(path, opts, dtype) -> bool:
    """Slow tier: on the Triton path each option in one dtype, alternating (both dtypes run the kernel
    fast in test_plain_and_ignore); the torch path keeps both."""
    return path == "triton" and dtype == (F32 if OPTIONS.index(opts) % 2 else BF16)


@pytest.mark.parametrize("path,opts,dtype", tiered(
    [(p, opts, dtype) for p in PATHS for opts in OPTIONS for dtype in (F32, BF16)], _slow_option), indirect=["path"])
def test_options(opts, dtype, path, device, gen):
    opts = dict(opts)
    bias = opts.pop("bias", False)
    upstream = opts.pop("upstream", 1.0)
    hid, w, b, labels = _inputs(29, 32, 1000, dtype, device, gen, bias=bias, ignore=(2, 5, 28))
    _check_against_oracle(hid, w, b, labels, dtype, upstream=upstream, chunk_size=6, **opts)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_all_ignored_is_zero_not_nan(reduction, path, device, gen):
    hid, w, b, labels = _inputs(10, 16, 300, F32, device, gen, bias=True, ignore=range(10))
    loss, grads = _run(L.fused_linear_cross_entropy, hid, w, b, labels, reduction=reduction, chunk_size=4,
                       label_smoothing=0.1, z_loss_scale=1e-3)
    assert float(loss) == 0.0
    for g in grads:
        assert torch.count_nonzero(g) == 0


def test_frozen_weight_and_no_grad(path, device, gen):
    """LoRA freezes the LM head: no weight gradient is computed or returned; under no_grad only the loss."""
    hid, w, _, labels = _inputs(21, 16, 500, F32, device, gen, ignore=(4,))
    w.requires_grad_(False)
    _check_against_oracle(hid, w, None, labels, F32, chunk_size=5)
    assert w.grad is None
    with torch.no_grad():
        loss = L.fused_linear_cross_entropy(hid, w, labels, chunk_size=5)
    assert not loss.requires_grad
    assert_train_close(loss, L.fused_linear_cross_entropy_ref(hid, w, labels).detach())


def test_batched_leading_dims(path, device, gen):
    hid, w, _, labels = _inputs(12, 16, 300, F32, device, gen, ignore=(0, 7))
    hid3 = hid.detach().view(2, 6, 16).requires_grad_()
    loss = L.fused_linear_cross_entropy(hid3, w, labels.view(2, 6), chunk_size=5)
    loss.backward()
    loss_ref, (g_ref, _, _) = _run(L.fused_linear_cross_entropy_ref, hid, w, None, labels)
    assert_train_close(loss.detach(), loss_ref)
    assert_train_close(hid3.grad.view(12, 16), g_ref)


@pytest.mark.parametrize("smoothing,z,dtype", tiered(
    [(0.0, 0.0, F32), (0.1, 1e-2, BF16), (0.0, 0.0, BF16), (0.1, 1e-2, F32)],
    lambda smoothing, z, dtype: (smoothing > 0) == (dtype == F32)))  # slow: the other dtype of each
def test_row_kernel_matches_torch_rows(smoothing, z, dtype, device, gen):
    """Rule 1: the Triton row kernel against its torch twin (``ce_chunk_ref``), loss, lse and the in-place grad."""
    c, v = 11, 5000
    logits = (3 * torch.randn(c, v, generator=gen)).to(device, dtype)
    labels = torch.randint(0, v, (c,), generator=gen).to(device)
    labels[3] = IGNORE
    scale = torch.tensor([0.25], device=device)
    a, b = logits.clone(), logits.clone()
    loss, lse = L._ce_chunk_triton(a, labels, scale, IGNORE, smoothing, z)
    loss_ref, lse_ref = L.ce_chunk_ref(b, labels, scale, IGNORE, smoothing, z)
    assert_train_close(loss, loss_ref, F32)
    assert_train_close(lse, lse_ref, F32)
    assert_train_close(a, b)
    assert torch.count_nonzero(a[3]) == 0


def test_default_chunk_bounds_the_logits():
    # the bundled model: H 576, V 49152 -> 2048 tokens in chunks of 256 rows (the logits chunk: 1/8 of T x V)
    assert L.default_chunk_size(2048, 576, 49152) == 256
    assert L.default_chunk_size(1, 576, 49152) == 1
    assert L.default_chunk_size(65536, 4096, 128256) == 2048


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(labels=torch.tensor([0, 5, 300])), "outside the vocabulary"),
        (dict(labels=torch.tensor([0, -3, 1])), "outside the vocabulary"),
        (dict(labels=torch.tensor([0, 1])), "labels must be"),
        (dict(labels=torch.tensor([0.0, 1.0, 2.0])), "integers"),
        (dict(weight=torch.randn(300, 9)), "expected hidden"),
        (dict(bias=torch.randn(7)), "bias must be"),
        (dict(reduction="none"), "reduction"),
        (dict(label_smoothing=1.5), "label_smoothing"),
        (dict(z_loss_scale=-1.0), "z_loss_scale"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(hidden=torch.randn(3, 8, dtype=BF16)), "dtype"),
    ],
)
def test_bad_input(change, match):
    args = dict(hidden=torch.randn(3, 8), weight=torch.randn(300, 8), labels=torch.tensor([0, IGNORE, 299]))
    args.update(change)
    with pytest.raises(ValueError, match=match):
        L.fused_linear_cross_entropy(**args)


def test_second_backward_is_a_clear_error(gen):
    hid, w, _, labels = _inputs(5, 8, 50, F32, "cpu", gen)
    loss = L.fused_linear_cross_entropy(hid, w, labels)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="one backward per call"):
        loss.backward()


def test_strided_hidden(path, device, gen):
    """A column slice of a wider tensor (row stride 40) and a transposed weight view."""
    big = torch.randn(11, 40, generator=gen).to(device).requires_grad_()
    wt = (0.3 * torch.randn(24, 300, generator=gen)).to(device).requires_grad_()
    labels = torch.randint(0, 300, (11,), generator=gen).to(device)
    loss = L.fused_linear_cross_entropy(big[:, 3:27], wt.t(), labels, chunk_size=4)
    loss.backward()
    loss = loss.detach()
    grads = [big.grad.clone(), wt.grad.clone()]
    big.grad = wt.grad = None
    loss_ref = L.fused_linear_cross_entropy_ref(big[:, 3:27], wt.t(), labels)
    loss_ref.backward()
    assert_train_close(loss, loss_ref.detach())
    assert_train_close(grads[0], big.grad)
    assert_train_close(grads[1], wt.grad)


def test_autocast_master_weights(path, device, gen):
    """fp32 master weights under bf16 autocast: the head runs in bf16 like autocast's F.linear and the
    gradients reach the fp32 leaves."""
    hid, w, b, labels = _inputs(19, 32, 700, F32, device, gen, bias=True, ignore=(3,))
    with torch.autocast(device.type, dtype=BF16):
        loss, grads = _run(L.fused_linear_cross_entropy, hid, w, b, labels, chunk_size=5)
        loss_ref, grads_ref = _run(L.fused_linear_cross_entropy_ref, hid, w, b, labels)
    assert loss.dtype == F32
    assert_train_close(loss, loss_ref, BF16)
    for g, g_ref in zip(grads, grads_ref):
        assert g.dtype == F32
        assert_train_close_scaled(g, g_ref, BF16)
