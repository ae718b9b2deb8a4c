"""lora_delta (multi-LoRA's gathered shrink/expand): the Triton kernel (interpreter on CPU) against the
segmented reference, over mixed slots (base rows, several adapters, ragged sizes, one token, empty)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.tolerances import assert_close
from tokenfab.kernels import lora

CASES = [  # (tokens, K, N, r, slots in the pool)
    (1, 16, 16, 4, 1),
    (7, 64, 48, 8, 3),
    (13, 96, 200, 16, 4),
    (5, 33, 17, 3, 2),  # odd sizes: masked K, N and rank
    (0, 32, 32, 8, 2),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("t,k,n,r,s", CASES)
def test_lora_delta_matches_reference(t, k, n, r, s, dtype, gen, device):
    x = torch.randn(t, k, generator=gen).to(dtype).to(device)
    a = (torch.randn(s, r, k, generator=gen) * 0.3).to(dtype).to(device)
    b = (torch.randn(s, n, r, generator=gen) * 0.3).to(dtype).to(device)
    slots = torch.randint(-1, s, (t,), generator=gen, dtype=torch.int32).to(device)
    out, ref = lora._lora_delta_triton(x, slots, a, b), lora.lora_delta_ref(x, slots, a, b)
    assert_close(out, ref)
    base_rows = (slots < 0).cpu()
    assert (out.cpu()[base_rows] == 0).all()  # no adapter: an exact zero delta


def test_reference_is_per_token_b_a_x(gen):
    x = torch.randn(4, 8, generator=gen)
    a, b = torch.randn(2, 3, 8, generator=gen), torch.randn(2, 5, 3, generator=gen)
    slots = torch.tensor([1, -1, 0, 1], dtype=torch.int32)
    want = torch.stack([b[1] @ a[1] @ x[0], torch.zeros(5), b[0] @ a[0] @ x[2], b[1] @ a[1] @ x[3]])
    torch.testing.assert_close(lora.lora_delta_ref(x, slots, a, b), want)


def test_custom_op_dispatches_to_triton(monkeypatch, gen, device):
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    x = torch.randn(3, 40, generator=gen).to(device)
    a, b = torch.randn(2, 4, 40, generator=gen).to(device), torch.randn(2, 24, 4, generator=gen).to(device)
    slots = torch.tensor([0, 1, -1], dtype=torch.int32, device=device)
    assert_close(torch.ops.tokenfab.lora_delta(x, slots, a, b), lora.lora_delta_ref(x, slots, a, b))


def test_bad_shapes_are_refused(device):
    x = torch.zeros(2, 8, device=device)
    with pytest.raises(ValueError, match="do not fit"):
        lora._lora_delta_triton(x, torch.zeros(2, dtype=torch.int32, device=device), torch.zeros(1, 2, 9),
                                torch.zeros(1, 4, 2))


@pytest.mark.parametrize("t,k,n,r,s", CASES + [(64, 96, 40, 8, 8), (65, 24, 16, 4, 3)])
def test_cpu_path_matches_reference(t, k, n, r, s, gen):
    """The CPU path (dense over every slot, masked; the reference above DENSE_MAX_ROWS rows)."""
    x = torch.randn(t, k, generator=gen)
    a, b = torch.randn(s, r, k, generator=gen) * 0.3, torch.randn(s, n, r, generator=gen) * 0.3
    slots = torch.randint(-1, s, (t,), generator=gen, dtype=torch.int32)
    out = lora.lora_delta_cpu(x, slots, a, b)
    assert_close(out, lora.lora_delta_ref(x, slots, a, b))
    assert (out[slots < 0] == 0).all()
