"""The ops trace through torch.compile(fullgraph=True): fake impls and mutation declarations."""

from __future__ import annotations

import torch

import tokenfab.kernels  # noqa: F401  (registers torch.ops.tokenfab)
from tests.kernels.tolerances import assert_close


def _layer(x, residual, w, pos, cs, wqkv, kc, vc, slots, bt, cu, ctx, logits, t, k, p, m, seeds):
    """One decoder-layer-shaped use of every op (2 tokens, 4/2 heads of 16)."""
    ops = torch.ops.tokenfab
    h = ops.add_rms_norm(x, residual, w, 1e-6)
    qkv = h @ wqkv
    q, kk, v = qkv[:, :64].view(2, 4, 16), qkv[:, 64:96].view(2, 2, 16), qkv[:, 96:].view(2, 2, 16)
    q, kk = ops.rotary_embedding(pos, q, kk, cs, True)
    ops.store_kv(kk, v, kc, vc, slots)
    a = ops.paged_attention(q, kc, vc, bt, cu, ctx, 1, 8, 0.25)
    y = ops.silu_and_mul(torch.cat((a.reshape(2, 64), a.reshape(2, 64)), -1)) + ops.gelu_and_mul(
        torch.cat((a.reshape(2, 64), a.reshape(2, 64)), -1), "tanh")
    y = ops.rms_norm(y, w, 1e-6)
    return y, ops.sample(logits, t, k, p, m, seeds)


def _inputs():
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)
    return [
        r(2, 64), r(2, 64), r(64), torch.tensor([5, 7]), r(16, 16), r(64, 128),
        torch.zeros(4, 4, 2, 16), torch.zeros(4, 4, 2, 16), torch.tensor([5, 13]),
        torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([0, 1, 2], dtype=torch.int32),
        torch.tensor([6, 8], dtype=torch.int32), r(2, 50), torch.tensor([0.0, 0.7]),
        torch.tensor([-1, 5]), torch.tensor([1.0, 0.9]), torch.tensor([0.0, 0.0]), torch.tensor([3, 4]),
    ]


def test_fullgraph_compile_matches_eager():
    eager_in, compiled_in = _inputs(), _inputs()
    y_ref, tok_ref = _layer(*eager_in)
    compiled = torch.compile(_layer, fullgraph=True, backend="aot_eager")
    y, tok = compiled(*compiled_in)
    assert_close(y, y_ref)
    assert torch.equal(tok, tok_ref)
    # the in-place updates (residual, K/V cache) happened under compile too
    for i in (1, 6, 7):
        assert_close(compiled_in[i], eager_in[i])
