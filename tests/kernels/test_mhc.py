"""The fused mHC kernels (tokenfab/kernels/mhc.py) in the interpreter against their references: odd token counts
(one token, a block and a bit), stream counts 3 (padded to 4), 4 (DeepSeek-V4's) and 8, hidden sizes that are
not multiples of the tiles, float32 and bfloat16 streams; the Sinkhorn output doubly stochastic; and the compile
for sm_90 (``mhc_hopper_compile.py``: no spills, registers and shared memory within budget)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.tolerances import assert_close
from tokenfab.kernels import mhc

CASES = [(3, 64, 5), (4, 96, 37), (4, 40, 1), (8, 32, 17)]


def _inputs(n: int, d: int, t: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(n * 1000 + d + t)
    h = torch.randn(t, n, d, generator=g).to(dtype)
    fn = torch.randn((2 + n) * n, n * d, generator=g) * 0.2
    base = torch.randn((2 + n) * n, generator=g) * 0.2
    scale = torch.randn(3, generator=g) * 0.5 + 1
    return h, fn, base, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,d,t", CASES)
def test_mhc_pre_matches_reference(n, d, t, dtype):
    h, fn, base, scale = _inputs(n, d, t, dtype)
    ref = mhc.mhc_pre_ref(h, fn, base, scale, 20, 1e-6, 1e-6)
    got = mhc._mhc_pre_triton(h, fn, base, scale, 20, 1e-6, 1e-6)
    assert got[0].dtype == dtype and got[1].dtype == got[2].dtype == torch.float32
    assert_close(got[0], ref[0])
    assert_close(got[1], ref[1], torch.float32)
    assert_close(got[2], ref[2], torch.float32)
    # Sinkhorn: after 20 rounds every column sums to 1 (the last normalization) and every row nearly so
    torch.testing.assert_close(got[2].sum(dim=-2), torch.ones(t, n), atol=1e-4, rtol=0)
    torch.testing.assert_close(got[2].sum(dim=-1), torch.ones(t, n), atol=5e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,d,t", CASES)
def test_mhc_post_matches_reference(n, d, t, dtype):
    h, fn, base, scale = _inputs(n, d, t, dtype)
    _, post, comb = mhc.mhc_pre_ref(h, fn, base, scale, 20, 1e-6, 1e-6)
    out = torch.randn(t, d).to(dtype)
    assert_close(mhc._mhc_post_triton(h, out, post, comb), mhc.mhc_post_ref(h, out, post, comb))


def test_empty_batch():
    h, fn, base, scale = _inputs(4, 32, 0, torch.float32)
    x, post, comb = mhc._mhc_pre_triton(h, fn, base, scale, 20, 1e-6, 1e-6)
    assert x.shape == (0, 32) and post.shape == (0, 4) and comb.shape == (0, 4, 4)
    assert mhc._mhc_post_triton(h, torch.zeros(0, 32), post, comb).shape == (0, 4, 32)


@pytest.fixture(scope="module", params=[pytest.param([("mhc_hopper_compile.py", ())], id="sm90")])
def hopper_runs(request) -> list:
    return request.param


def test_hopper_compile(hopper_batch, hopper_runs):
    """Both kernels compile for sm_90 at DeepSeek-V4's sizes (4 streams of 4096 and 7168, bf16 and float32
    streams, a prefill and a decode batch): no spills, registers and shared memory within budget."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from tests.kernels.hopper_harness import H100_MAX_SHARED
    from tests.kernels.mhc_hopper_compile import kernel_modules

    records = hopper_batch(hopper_runs)
    defined = {name for mod in kernel_modules() for name, obj in vars(mod).items()
               if isinstance(obj, (JITFunction, InterpretedFunction)) and name.endswith("_kernel")}
    assert defined == {"_mhc_pre_kernel", "_mhc_post_kernel"} <= {r["kernel"] for r in records}
    for r in records:
        assert not r["local"] and not r["stack"], r
        assert r["shared"] <= H100_MAX_SHARED, r
        assert r["registers"] * 32 * r["num_warps"] <= 65536, r
