"""The native CPU kernels refuse what would make them read or write outside their tensors.

A scheduler bug (a block id past the cache, a slot past the cache, a negative position, a
context longer than its block table) must be a ValueError, not heap corruption; a failed
malloc inside a kernel must be an exception, not a crash.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from tests.kernels.test_attention import _batch
from tokenfab.kernels import attention
from tokenfab.kernels.cpu import attention as na
from tokenfab.kernels.cpu import elementwise as ne

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))


def _decode(gen, ctx_lens=(5, 40, 17)):
    return _batch([1] * len(ctx_lens), list(ctx_lens), 4, 2, 32, 16, torch.float32, gen, "cpu")


def _prefill(gen):
    return _batch([3, 1, 20], [9, 40, 20], 4, 2, 32, 16, torch.float32, gen, "cpu")


def test_valid_inputs_still_match_the_reference(gen):
    """The checks let a valid batch through (block-table padding past the used blocks may hold anything)."""
    q, kc, vc, bt, cu, ctx = _prefill(gen)
    bt[0, 1:] = -7  # sequence 0 (9 tokens) uses block 0 only: its padding is never read
    out = na.paged_attention_native(q, kc, vc, bt, cu, ctx, 0.2)
    bt[0, 1:] = bt[1, 0]
    ref = attention.paged_attention_ref(q, kc, vc, bt, cu, ctx, 20, 40, 0.2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("decode", [True, False])
@pytest.mark.parametrize("bad", ["past_cache", "negative"])
def test_block_id_outside_the_cache(gen, decode, bad):
    q, kc, vc, bt, cu, ctx = _decode(gen) if decode else _prefill(gen)
    bt[1, 2] = kc.shape[0] if bad == "past_cache" else -1  # sequence 1 (40 tokens) reads blocks 0..2
    with pytest.raises(ValueError, match="block id"):
        if decode:
            na.paged_decode_attention_native(q, kc, vc, bt, ctx, 0.2)
        else:
            na.paged_attention_native(q, kc, vc, bt, cu, ctx, 0.2)


@pytest.mark.parametrize("decode", [True, False])
def test_index_checks_run_once_a_step_but_see_every_change(gen, decode, monkeypatch):
    """Every layer of a step passes the same index tensors: they are checked once (the numpy
    reductions of checks.check_paged_indices), yet an in-place change, a new tensor or another
    cache is checked again."""
    from tokenfab.kernels.cpu import checks

    q, kc, vc, bt, cu, ctx = _decode(gen) if decode else _prefill(gen)
    calls = []
    real = checks.check_paged_indices
    monkeypatch.setattr(checks, "check_paged_indices", lambda *a: calls.append(1) or real(*a))

    def run(q=q, kc=kc, vc=vc, bt=bt, ctx=ctx):
        if decode:
            return na.paged_decode_attention_native(q, kc, vc, bt, ctx, 0.2)
        return na.paged_attention_native(q, kc, vc, bt, cu, ctx, 0.2)

    first = run()
    for _ in range(3):  # "layers"
        assert torch.equal(run(), first)
    assert len(calls) == 1
    bt[1, 2] = kc.shape[0]  # in place: the version counter moves
    with pytest.raises(ValueError, match="block id"):
        run()
    bad = bt.clone()  # a new tensor with the same bad id
    with pytest.raises(ValueError, match="block id"):
        run(bt=bad)
    bt[1, 2] = 0
    run()
    n = len(calls)
    with pytest.raises(ValueError, match="block id"):  # fewer blocks: block 0..2 of a 2-block cache
        run(kc=kc[:2], vc=vc[:2])
    assert len(calls) == n + 1
    if not decode:
        with pytest.raises(ValueError, match="ending at"):  # same indices, fewer query rows
            na.paged_attention_native(q[:-1], kc, vc, bt, cu, ctx, 0.2)
    with torch.inference_mode():  # inference tensors have no version counter: checked every time
        bt_i, ctx_i = bt.clone(), ctx.clone()
        n = len(calls)
        run(bt=bt_i, ctx=ctx_i)
        bt_i[1, 2] = kc.shape[0]
        with pytest.raises(ValueError, match="block id"):
            run(bt=bt_i, ctx=ctx_i)
        assert len(calls) == n + 2


def test_context_longer_than_its_block_table(gen):
    q, kc, vc, bt, _, ctx = _decode(gen)
    ctx[2] = bt.shape[1] * 16 + 1
    with pytest.raises(ValueError, match="longer than its block table"):
        na.paged_decode_attention_native(q, kc, vc, bt, ctx, 0.2)


def test_negative_context(gen):
    q, kc, vc, bt, _, ctx = _decode(gen)
    ctx[0] = -3
    with pytest.raises(ValueError, match="negative"):
        na.paged_decode_attention_native(q, kc, vc, bt, ctx, 0.2)


def test_attention_shape_mismatches(gen):
    q, kc, vc, bt, cu, ctx = _prefill(gen)
    with pytest.raises(ValueError, match="rows for"):  # block table rows != sequences
        na.paged_attention_native(q, kc, vc, bt[:2], cu, ctx, 0.2)
    with pytest.raises(ValueError, match="head size"):  # q's head size != the cache's
        na.paged_attention_native(q[..., :16].contiguous(), kc, vc, bt, cu, ctx, 0.2)
    with pytest.raises(ValueError, match="disagree"):  # k and v caches of different block counts
        na.paged_attention_native(q, kc, vc[:-1], bt, cu, ctx, 0.2)
    with pytest.raises(ValueError, match="sinks"):
        na.paged_attention_native(q, kc, vc, bt, cu, ctx, 0.2, sinks=torch.zeros(3))
    bad_cu = cu.clone()
    bad_cu[0] = -1
    with pytest.raises(ValueError):
        na.paged_attention_native(q, kc, vc, bt, bad_cu, ctx, 0.2)
    with pytest.raises(ValueError, match="dimensions"):
        na.paged_attention_native(q, kc, vc, bt[0], cu, ctx, 0.2)


def test_dispatcher_raises_too(gen):
    """What the layers call (kernels.attention.paged_attention_cpu) surfaces the error."""
    q, kc, vc, bt, cu, ctx = _prefill(gen)
    bt[2, 1] = 10_000
    with pytest.raises(ValueError, match="block id 10000"):
        attention.paged_attention_cpu(q, kc, vc, bt, cu, ctx, 20, 40, 0.2)


def _kv(t=4, h=2, d=8, nb=3, bs=4):
    k, v = torch.randn(t, h, d), torch.randn(t, h, d)
    return k, v, torch.zeros(nb, bs, h, d), torch.zeros(nb, bs, h, d)


def test_store_kv_slots():
    k, v, kc, vc = _kv()
    assert ne.store_kv(k, v, kc, vc, torch.tensor([0, -1, 5, 11])) is True  # 3 blocks of 4: slots 0..11
    torch.testing.assert_close(kc.view(12, 2, 8)[11], k[3])
    for slots in ([0, 1, 2, 12], [0, -2, 1, 2], [0, 1, 2, 1 << 40]):
        with pytest.raises(ValueError, match="slot"):
            ne.store_kv(k, v, kc, vc, torch.tensor(slots))
    with pytest.raises(ValueError, match="entries for 4 tokens"):
        ne.store_kv(k, v, kc, vc, torch.tensor([0, 1, 2]))


def test_store_kv_shapes():
    k, v, kc, vc = _kv()
    slots = torch.arange(4)
    with pytest.raises(ValueError, match="do not fit"):  # cache of other head count
        ne.store_kv(k, v, torch.zeros(3, 4, 1, 8), vc, slots)
    with pytest.raises(ValueError, match="do not fit"):  # v of other token count
        ne.store_kv(k, v[:3], kc, vc, slots)
    with pytest.raises(ValueError, match="different numbers of slots"):
        ne.store_kv(k, v, kc, vc[:2], slots)


def test_rotary_positions_and_shapes():
    q, k = torch.randn(3, 4, 16), torch.randn(3, 2, 16)
    cs = torch.randn(10, 16)
    assert ne.rotary_embedding(torch.tensor([0, 4, 9]), q, k, cs, True) is not None
    with pytest.raises(ValueError, match="negative position"):
        ne.rotary_embedding(torch.tensor([0, -1, 2]), q, k, cs, True)
    with pytest.raises(ValueError, match="past the rotary cache"):
        ne.rotary_embedding(torch.tensor([0, 10, 2]), q, k, cs, True)
    with pytest.raises(ValueError, match="shape"):
        ne.rotary_embedding(torch.tensor([0, 1]), q, k, cs, True)
    with pytest.raises(ValueError, match="rotary_dim"):
        ne.rotary_embedding(torch.tensor([0, 1, 2]), q, k, torch.randn(10, 32), True)


def test_rms_norm_shapes():
    x = torch.randn(3, 16)
    with pytest.raises(ValueError, match="weight"):
        ne.rms_norm(x, torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="weight"):
        ne.add_rms_norm(x, x.clone(), torch.ones(32), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        ne.add_rms_norm(x, torch.randn(1, 48), torch.ones(16), 1e-6)


OOM_CHECK = """
import resource, torch
from tokenfab.kernels.cpu import attention as na, native_library
assert native_library() is not None
hq, L, bs = 256, 4_000_000, 16  # the decode task's buffer: 256 rows x L scores x 4 bytes = 4 GB
nb = L // bs
kc = torch.zeros(nb, bs, 1, 1)
bt = torch.arange(nb, dtype=torch.int32)[None]
q = torch.zeros(1, hq, 1)
ctx = torch.tensor([L], dtype=torch.int32)
vm = int(next(l for l in open("/proc/self/status") if l.startswith("VmSize")).split()[1]) * 1024
resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.RLIM_INFINITY))
try:
    na.paged_decode_attention_native(q, kc, kc, bt, ctx, 1.0)
except MemoryError as e:
    print("raised:", e)
"""


def test_failed_malloc_is_an_exception(tmp_path):
    """Under an address-space limit the kernel's work buffer cannot be allocated: MemoryError, no crash."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    env.pop("TOKENFAB_CPU_NATIVE", None)
    proc = subprocess.run([sys.executable, "-c", OOM_CHECK], env=env, capture_output=True, text=True, timeout=120,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "raised: native CPU kernel paged_attention_f32: could not allocate" in proc.stdout


def test_random_corruptions_raise_or_match_the_reference():
    """A seeded fuzz over index tensors: each corrupted batch is either refused with ValueError or
    valid, and then the kernel's output equals the reference's (no read outside the cache)."""
    rng = torch.Generator().manual_seed(7)
    refused = accepted = 0
    for it in range(150):
        q_lens = [int(x) for x in torch.randint(1, 5, (3,), generator=rng)]
        ctx_lens = [q + int(x) for q, x in zip(q_lens, torch.randint(0, 40, (3,), generator=rng))]
        q, kc, vc, bt, cu, ctx = _batch(q_lens, ctx_lens, 4, 2, 16, 8, torch.float32, rng, "cpu")
        nb, w = kc.shape[0], bt.shape[1]
        what = it % 3
        if what == 0:  # a block id anywhere in the table, in or out of range
            i, j = int(torch.randint(0, 3, (1,), generator=rng)), int(torch.randint(0, w, (1,), generator=rng))
            bt[i, j] = int(torch.randint(-3, nb + 3, (1,), generator=rng))
        elif what == 1:  # a context length, in or out of what the table covers
            i = int(torch.randint(0, 3, (1,), generator=rng))
            ctx[i] = int(torch.randint(-2, w * 8 + 4, (1,), generator=rng))
        else:  # a query row count
            i = int(torch.randint(1, 4, (1,), generator=rng))
            cu[i:] += int(torch.randint(-2, 3, (1,), generator=rng))
        try:
            out = na.paged_attention_native(q, kc, vc, bt, cu, ctx, 0.3)
        except ValueError:
            refused += 1
            continue
        accepted += 1
        # the reference gathers up to the longest context in every row: give it in-range padding
        used = torch.arange(w) < ((ctx + 7) // 8)[:, None]
        ref = attention.paged_attention_ref(q, kc, vc, torch.where(used, bt, 0), cu, ctx,
                                            int((cu[1:] - cu[:-1]).max()), int(ctx.max()), 0.3)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    assert refused > 20 and accepted > 20  # both sides of the line were reached
