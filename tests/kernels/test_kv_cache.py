"""store_kv: Triton vs reference (slot -1 skipped, dtype cast into the cache)."""

from __future__ import annotations

import pytest
import torch

from tokenfab.kernels import kv_cache

CASES = [
    # tokens, kv heads, head dim, blocks, block size
    (5, 2, 64, 4, 16),
    (7, 3, 40, 3, 4),  # odd heads, head dim not a power of two
    (1, 8, 128, 2, 16),  # one token
]


@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                    (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("case", CASES)
def test_store_kv(case, dtypes, gen, device):
    t, h, d, nb, bs = case
    dt, cdt = dtypes
    k = torch.randn(t, h, d, generator=gen).to(dt).to(device)
    v = torch.randn(t, h, d, generator=gen).to(dt).to(device)
    slots = torch.randperm(nb * bs, generator=gen)[:t]
    slots[0] = -1  # padding token
    slots = slots.to(device)
    kc = torch.randn(nb, bs, h, d, generator=gen).to(cdt).to(device)
    vc = torch.randn(nb, bs, h, d, generator=gen).to(cdt).to(device)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kv_cache._store_kv_triton(k, v, kc, vc, slots)
    kv_cache.store_kv_ref(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref)
    assert torch.equal(vc, vc_ref)


def test_store_kv_strided_views_and_last_slot(gen, device):
    """k/v sliced from a fused qkv tensor; writes into the last slot of the last block."""
    t, hq, hk, d, nb, bs = 3, 4, 2, 32, 2, 8
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(device)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    v = qkv[:, (hq + hk) * d :].view(t, hk, d)
    slots = torch.tensor([nb * bs - 1, 0, bs], device=device)
    kc = torch.zeros(nb, bs, hk, d, device=device)
    vc = torch.zeros_like(kc)
    kc_ref, vc_ref = kc.clone(), vc.clone()
    kv_cache._store_kv_triton(k, v, kc, vc, slots)
    kv_cache.store_kv_ref(k, v, kc_ref, vc_ref, slots)
    assert torch.equal(kc, kc_ref) and torch.equal(vc, vc_ref)


def test_store_kv_empty_and_all_padding(device):
    kc = torch.zeros(2, 4, 1, 16, device=device)
    vc = torch.zeros_like(kc)
    kv_cache._store_kv_triton(torch.empty(0, 1, 16, device=device), torch.empty(0, 1, 16, device=device),
                              kc, vc, torch.empty(0, dtype=torch.long, device=device))
    kv_cache._store_kv_triton(torch.ones(2, 1, 16, device=device), torch.ones(2, 1, 16, device=device),
                              kc, vc, torch.full((2,), -1, device=device))
    assert not kc.any() and not vc.any()


def test_custom_op_dispatches_to_triton(monkeypatch, gen, device):
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    k = torch.randn(2, 1, 16, generator=gen).to(device)
    kc = torch.zeros(2, 4, 1, 16, device=device)
    vc = torch.zeros_like(kc)
    torch.ops.tokenfab.store_kv(k, k * 2, kc, vc, torch.tensor([5, 2], device=device))
    assert torch.equal(kc[1, 1], k[0]) and torch.equal(vc[0, 2], 2 * k[1])
