"""FP8 kernels (kernels/quant.py) in the interpreter against their references and plain definitions."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.tolerances import assert_close
from tokenfab.kernels import quant

FP8 = torch.float8_e4m3fn


def _rand(gen, *shape, scale=1.0):
    return torch.randn(*shape, generator=gen) * scale


@pytest.mark.parametrize("m,k", [(0, 128), (1, 128), (5, 200), (33, 96), (17, 384)])
@pytest.mark.parametrize("ue8m0", [False, True])
def test_per_token_group_quant(device, gen, m, k, ue8m0):
    x = _rand(gen, m, k, scale=3.0)
    x[:, :7] *= 100  # a group with a large outlier
    q, s = quant._per_token_group_quant_triton(x.to(device), 128, ue8m0)
    rq, rs = quant.per_token_group_quant_fp8_ref(x, 128, ue8m0)
    assert q.dtype == FP8 and q.shape == (m, k) and s.shape == (m, (k + 127) // 128)
    torch.testing.assert_close(s.cpu(), rs, rtol=1e-6, atol=0)
    torch.testing.assert_close(q.cpu().float(), rq.float(), rtol=0, atol=0)
    if m and ue8m0:  # powers of two
        assert torch.equal(torch.exp2(torch.log2(rs).round()), rs)
    if m:  # the definition: dequantized values within half an fp8 step (2^-3 relative) of x
        deq = rq.float() * rs.repeat_interleave(128, 1)[:, :k]
        torch.testing.assert_close(deq, x, rtol=2**-4, atol=float(rs.max()) * 2**-9 * 448 / 448 + 1e-3)


def _block_weight(gen, n, k, group_n):
    """A float8 weight and its scale grid (as checkpoints store them: q * scale_inv)."""
    w = _rand(gen, n, k)
    ns = (n + group_n - 1) // group_n
    ks = (k + 127) // 128 if group_n > 1 else 1
    s = torch.rand(ns, ks, generator=gen) * 0.02 + 0.001
    q = (w / 0.5).clamp(-448, 448).to(FP8)
    return q, s


@pytest.mark.parametrize("m,n,k", [(0, 64, 128), (1, 96, 96), (3, 200, 300), (20, 128, 256), (70, 130, 384),
                                   (130, 64, 130)])
@pytest.mark.parametrize("group_n", [128, 1])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_w8a8_scaled_mm(device, gen, m, n, k, group_n, out_dtype):
    a, a_s = quant.per_token_group_quant_fp8_ref(_rand(gen, m, k), 128, False)
    if group_n == 1:  # per-channel weights, per-token activations (one scale a row)
        a_s = torch.rand(m, 1, generator=gen) * 0.01 + 0.001
    w, w_s = _block_weight(gen, n, k, group_n)
    got = quant._w8a8_scaled_mm_triton(a.to(device), a_s.to(device), w.to(device), w_s.to(device), group_n,
                                       out_dtype)
    ref = quant.w8a8_scaled_mm_ref(a, a_s, w, w_s, group_n, out_dtype)
    assert_close(got, ref)
    # the reference against the definition: dequantize both sides, multiply
    deq_a = quant.dequantize_fp8(a, a_s, 1, torch.float64)
    deq_w = quant.dequantize_fp8(w, w_s, group_n, torch.float64)
    torch.testing.assert_close(ref.double(), (deq_a @ deq_w.T).to(out_dtype).double(),
                               **({"rtol": 1e-5, "atol": 1e-5} if out_dtype == torch.float32
                                  else {"rtol": 1.6e-2, "atol": 1.6e-2}))


def test_fp8_linear_paths_agree(device, gen, monkeypatch):
    """The CPU path (weight-only, dequantized per call) and the W8A8 Triton path differ only by the
    activation quantization: within a few fp8 steps of the result."""
    x = _rand(gen, 4, 3, 200).to(device)
    w, w_s = (t.to(device) for t in _block_weight(gen, 150, 200, 128))
    bias = _rand(gen, 150).to(device)
    monkeypatch.setenv("TOKENFAB_KERNELS", "torch")
    plain = quant.fp8_linear(x, w, w_s, 128, bias)
    torch.testing.assert_close(plain, x @ quant.dequantize_fp8(w, w_s, 128, torch.float32).T + bias)
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    w8a8 = quant.fp8_linear(x, w, w_s, 128, bias)
    assert w8a8.shape == plain.shape
    rel = (w8a8 - plain).norm() / plain.norm()
    assert rel < 0.05, rel
    static = quant.fp8_linear(x, w, w_s, 128, None, input_scale=x.abs().max() / 448)
    assert (static - plain + bias).norm() / plain.norm() < 0.05


def test_ops_trace_through_torch_compile(gen):
    """Fake impls: the two custom ops trace with fullgraph=True and give the eager result."""

    def f(x, w, w_s):
        q, s = torch.ops.tokenfab.per_token_group_quant_fp8(x, 128, False)
        return torch.ops.tokenfab.w8a8_scaled_mm(q, s, w, w_s, 128, torch.float32)

    x = _rand(gen, 3, 200)
    w, w_s = _block_weight(gen, 130, 200, 128)
    eager = f(x, w, w_s)
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")(x, w, w_s)
    assert_close(compiled, eager)
