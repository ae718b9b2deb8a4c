"""rotary_embedding: Triton vs reference (NeoX / GPT-J, partial rotary, any position order)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.tolerances import assert_close
from tokenfab.kernels import rope


def _cache(max_pos: int, rot: int, dtype=torch.float32) -> torch.Tensor:
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    ang = torch.arange(max_pos, dtype=torch.float32)[:, None] * inv[None, :]
    return torch.cat((ang.cos(), ang.sin()), dim=-1).to(dtype)


CASES = [
    # tokens, q heads, k heads, head dim, rotary dim
    (5, 4, 2, 64, 64),
    (1, 32, 8, 128, 128),  # one decode token
    (7, 7, 1, 48, 16),  # odd head count, partial rotary
    (4, 5, 5, 80, 20),  # head dim not a power of two, rotary half not either
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("case", CASES)
def test_rotary(case, is_neox, dtype, gen, device):
    t, hq, hk, d, rot = case
    q = torch.randn(t, hq, d, generator=gen).to(dtype).to(device)
    k = torch.randn(t, hk, d, generator=gen).to(dtype).to(device)
    pos = torch.randint(0, 4096, (t,), generator=gen).to(device)  # any order, repeats allowed
    cs = _cache(4096, rot).to(device)
    qo, ko = rope._rotary_embedding_triton(pos, q, k, cs, is_neox)
    qr, kr = rope.rotary_embedding_ref(pos, q, k, cs, is_neox)
    assert_close(qo, qr)
    assert_close(ko, kr)


def test_rotary_strided_inputs_and_bf16_cache(gen, device):
    """q/k as views into a fused qkv output; a bf16 cos/sin cache; int32 positions."""
    t, hq, hk, d = 6, 6, 2, 32
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=gen).to(torch.bfloat16).to(device)
    q = qkv[:, : hq * d].view(t, hq, d)
    k = qkv[:, hq * d : (hq + hk) * d].view(t, hk, d)
    pos = torch.tensor([9, 3, 3, 0, 100, 7], dtype=torch.int32, device=device)
    cs = _cache(128, d, torch.bfloat16).to(device)
    for neox in (True, False):
        qo, ko = rope._rotary_embedding_triton(pos, q, k, cs, neox)
        qr, kr = rope.rotary_embedding_ref(pos, q, k, cs, neox)
        assert_close(qo, qr)
        assert_close(ko, kr)


def test_rotary_empty(device):
    q = torch.empty(0, 4, 64, device=device)
    k = torch.empty(0, 2, 64, device=device)
    qo, ko = rope._rotary_embedding_triton(torch.empty(0, dtype=torch.long, device=device), q, k,
                                           _cache(8, 64).to(device), True)
    assert qo.shape == q.shape and ko.shape == k.shape


def test_custom_op_dispatches_to_triton(monkeypatch, gen, device):
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    q = torch.randn(3, 4, 32, generator=gen).to(device)
    k = torch.randn(3, 2, 32, generator=gen).to(device)
    pos = torch.tensor([5, 1, 2], device=device)
    cs = _cache(16, 32).to(device)
    qo, ko = torch.ops.tokenfab.rotary_embedding(pos, q, k, cs, True)
    qr, kr = rope.rotary_embedding_ref(pos, q, k, cs, True)
    assert_close(qo, qr)
    assert_close(ko, kr)
