"""DeepSeek-V4's KV compressor (tokenfab/kernels/dsv4_compressor.py): the reference against the formula written
out window by window, the Triton kernel in the interpreter against the reference (CSA's two-series windows and
HCA's, ratios 4 to 128, head dims 32 / 40 (padded) / 64, rows from this step and from the ring, missing slots,
window 0's empty half, fp32 and bf16), and the layer's ``close_windows`` through the kernel against the PyTorch
path: prefill chunks of several sequences with odd lengths and different starts (windows closing inside the
chunk over rows of the ring), and decode steps of one row a sequence (every row pooled, partial windows
included); the sm_90 compile is in test_dsv4_attention.py (dsv4_hopper_compile.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from tests.kernels.tolerances import assert_close
from tokenfab.kernels import dsv4_compressor as k

COL = 5  # the compressor's columns start past other values of the row (the kv, another compressor)


def _rope_freqs(rd: int) -> torch.Tensor:
    return 1.0 / (1000.0 ** (torch.arange(0, rd, 2, dtype=torch.float32) / rd))


def _inputs(w, d, ratio, overlap, dtype, seed=0):
    g = torch.Generator().manual_seed(seed + 97 * d + ratio)
    width, s = d * (2 if overlap else 1), ratio * (2 if overlap else 1)
    new = torch.randn(40, COL + 2 * width + 3, generator=g).to(dtype)
    ring = torch.randn(30, COL + 2 * width + 3, generator=g).to(dtype)
    new_idx, ring_idx = torch.randint(0, 40, (w, s), generator=g), torch.randint(0, 30, (w, s), generator=g)
    new_idx[torch.rand(w, s, generator=g) < 0.5] = -1  # then the ring's row
    ring_idx[torch.rand(w, s, generator=g) < 0.2] = -1  # in neither: the slot is empty
    window = torch.randint(1, 60, (w,), generator=g)
    window[0] = 0
    if overlap:  # window 0 has no previous window
        new_idx[0, :ratio] = ring_idx[0, :ratio] = -1
    new_idx[-1, -1] = ring_idx[-1, -1] = -1
    weight = torch.randn(d, generator=g)
    return new, new_idx, ring, ring_idx, window, COL, d, ratio, overlap, weight, _rope_freqs(min(d, 16)), 1.25, 1e-6


CASES = [(5, 32, 4, True), (7, 40, 8, False), (3, 64, 128, False), (1, 32, 4, False), (4, 40, 16, True)]


def _formula(new, new_idx, ring, ring_idx, window, col, d, ratio, overlap, weight, inv_freq, scale, eps):
    """The module docstring's math, one window and one slot at a time, in float64 (but the RoPE angle)."""
    width = d * (2 if overlap else 1)
    rd = 2 * inv_freq.numel()
    out = []
    for w in range(new_idx.shape[0]):
        kvs, gates = [], []
        for j in range(new_idx.shape[1]):
            if new_idx[w, j] >= 0:
                row = new[new_idx[w, j]].double()
            elif ring_idx[w, j] >= 0:
                row = ring[ring_idx[w, j]].double()
            else:
                continue
            off = col + (d if overlap and j >= ratio else 0)
            kvs.append(row[off : off + d])
            gates.append(row[off + width : off + width + d])
        pooled = (torch.stack(kvs) * torch.stack(gates).softmax(dim=0)).sum(dim=0)
        y = pooled / (pooled.square().mean() + eps).sqrt() * weight.double()
        angle = ((window[w] * ratio).float() * inv_freq).double()  # the angle is a float32 product (RoPE's)
        cos, sin = angle.cos() * scale, angle.sin() * scale
        x0, x1 = y[d - rd :: 2].clone(), y[d - rd + 1 :: 2].clone()
        y[d - rd :: 2], y[d - rd + 1 :: 2] = x0 * cos - x1 * sin, x1 * cos + x0 * sin
        out.append(y)
    return torch.stack(out)


@pytest.mark.parametrize("w,d,ratio,overlap", CASES)
def test_reference_is_the_formula(w, d, ratio, overlap):
    args = _inputs(w, d, ratio, overlap, torch.float32)
    assert_close(k.dsv4_compress_ref(*args), _formula(*args).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("w,d,ratio,overlap", CASES)
def test_kernel_matches_reference(w, d, ratio, overlap, dtype):
    args = _inputs(w, d, ratio, overlap, dtype)
    assert_close(k._dsv4_compress_triton(*args), k.dsv4_compress_ref(*args))


def test_no_windows():
    args = list(_inputs(1, 32, 4, True, torch.float32))
    args[1], args[3], args[4] = args[1][:0], args[3][:0], args[4][:0]
    assert k._dsv4_compress_triton(*args).shape == (0, 32)


def test_registered_op():
    args = _inputs(3, 32, 4, True, torch.float32)
    torch.library.opcheck(torch.ops.tokenfab.dsv4_compress.default, args)


# ----------------------------------------------------------------------------- the layer's windows


def _compressor(overlap: bool, ratio: int, d: int = 32):
    from tokenfab.layers.dsv4_compressor import Compressor, InterleavedRope

    torch.manual_seed(3)
    rope = InterleavedRope(8, {"rope_theta": 1000.0}, 4096)
    comp = Compressor(24, d, ratio, overlap, rope, 1e-6)
    with torch.no_grad():
        for p in (comp.wkv.weight, comp.wgate.weight, comp.ape, comp.norm.weight):
            p.copy_(torch.randn_like(p) * 0.5)
    return comp


def _windows(comp, lens, starts, every_token, monkeypatch, kernels):
    """close_windows over one step: chunks of ``lens`` tokens at positions ``starts``, one state slot each
    (its ring holding random rows of the positions before the chunk)."""
    from tokenfab.layers.dsv4_compressor import TokenRows, close_windows

    g = torch.Generator().manual_seed(11)
    positions = torch.cat([torch.arange(s, s + n) for n, s in zip(lens, starts)])
    seq_of_token = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens).cumsum(0)
    x = torch.randn(positions.shape[0], 24, generator=g)
    new = torch.cat((torch.randn(positions.shape[0], 3, generator=g), comp.token_rows(x, positions)), dim=-1)
    ring = torch.randn(len(lens) + 1, 2 * comp.ratio, new.shape[1], generator=g)
    batch = SimpleNamespace(positions=positions, cu_seqlens_q=cu, state_slots=torch.arange(len(lens)) + 1)
    monkeypatch.setenv("TOKENFAB_KERNELS", kernels)
    return close_windows(comp, TokenRows(new, ring, batch, seq_of_token), 3, every_token)


@pytest.mark.parametrize("overlap,ratio", [(True, 4), (False, 8)])
@pytest.mark.parametrize(
    "every_token,lens,starts",
    [
        (False, [13, 1, 9, 30], [0, 7, 130, 3]),  # prefill chunks: windows closing on rows of this step and the ring
        (True, [1, 1, 1, 1, 1], [0, 3, 6, 7, 129]),  # decode: one row a sequence, partial windows pooled too
    ],
)
def test_close_windows_through_the_kernel(overlap, ratio, every_token, lens, starts, monkeypatch):
    comp = _compressor(overlap, ratio)
    ours = _windows(comp, lens, starts, every_token, monkeypatch, "triton")
    torch_path = _windows(comp, lens, starts, every_token, monkeypatch, "torch")
    assert ours[0].numel() > 0 and torch.equal(ours[1], torch_path[1]) and torch.equal(ours[3], torch_path[3])
    if every_token:
        assert 0 < int(ours[3].sum()) < len(lens)  # closing rows and partial ones both reached
    assert_close(ours[2], torch_path[2])
