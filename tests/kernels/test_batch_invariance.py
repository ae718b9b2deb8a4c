"""Batch invariance of the CPU paths that speculative decoding relies on (issue 15).

Speculation verifies k proposed tokens in one forward of k + 1 query rows per sequence; its output
is only "identical" to plain decoding when each of those rows gets, bit for bit, the logits a plain
decode step would give it (else near-ties flip). So a row's result must not depend on how many
other rows are computed with it:

- attention: the output of the query at position p, computed as a decode row (one query over a cache
  of p + 1 keys) and inside a multi-query "extend" row set of the same sequence (causal, same cache),
  with other sequences (decodes, a long prefill chunk, another extend) in the batch;
- linear layers: row r of X @ W^T for M = 1, k + 1, 17, 64 rows, and at any position inside M, for
  the packed GGUF kernel (default float32 activations and q8) and for the float32 row-invariant
  kernel that replaces MKL's sgemm in batch-invariant mode;
- end to end: the bundled model's logits via decode steps vs one (k + 1)-token extend;
- the Triton path (interpreter), in batch-invariant mode: the same attention property with extends run
  as decode rows through the split-KV decode kernel (fixed split count), mixed batches, GQA/MQA/MHA,
  window + softcap + sinks, float32 and bf16 (the Triton matmul and norm: test_matmul_invariant.py);
- the switch belongs to the runner: a runner's mode holds for its own forwards only.

Every comparison is ``torch.equal``: no tolerance.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

from tests.kernels.invariance import assert_rows_invariant
from tests.kernels.native_builds import PORTABLE, run_python
from tests.kernels.test_attention import _batch, _sinks
from tokenfab.kernels import attention
from tokenfab.kernels.batch_invariant import batch_invariant_mode
from tokenfab.kernels.cpu import native_library
from tokenfab.layers import linear as linear_mod

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_native = pytest.mark.skipif(native_library() is None, reason="no C compiler: the native kernels are not built")

# ---------------------------------------------------------------- attention


def _call(q, kc, vc, bt, q_lens, ctx_lens, scale, window, softcap, sinks):
    """The engine's CPU attention call (kernels.attention.paged_attention_native: decode-only
    batches go to the decode entry point, any other batch to the mixed one)."""
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    out = attention.paged_attention_native(q, kc, vc, bt, cu, ctx, max(q_lens), max(ctx_lens), scale, window,
                                           softcap, sinks)
    assert out is not None, "the native kernel did not take these tensors"
    return out


ATTN_CASES = [
    # Hq, Hkv, D, block size, window, softcap, sinks, dtype
    (9, 3, 64, 16, 0, 0.0, False, torch.float32),  # the bundled model's shape (GQA 3)
    (8, 2, 32, 16, 0, 0.0, False, torch.bfloat16),
    (4, 1, 32, 32, 40, 30.0, True, torch.float32),  # MQA, sliding window, softcap, sinks
    (6, 6, 40, 16, 0, 0.0, False, torch.float32),  # MHA, head dim not a multiple of 16 (scalar dots)
]


@needs_native
@pytest.mark.parametrize("case", ATTN_CASES, ids=lambda c: f"h{c[0]}-{c[1]}-d{c[2]}-w{c[4]}-{str(c[7])[6:]}")
@pytest.mark.parametrize("n_q", [2, 5, 32])
def test_attention_extend_rows_equal_decode_rows(case, n_q, gen):
    hq, hkv, d, bs, window, softcap, use_sinks, dtype = case
    scale = d**-0.5
    sinks = _sinks(use_sinks, hq, gen, "cpu")
    for length in (1, 63, 64, 65, 300):
        n = min(n_q, length)  # the extend's last query sees `length` keys, its first length - n + 1
        # sequences: a decode (ctx 37), the target extend, a prefill chunk of 40 (ctx 90), another extend
        q_lens, ctx_lens = [1, n, 40, 3], [37, length, 90, 20]
        q, kc, vc, bt, _, _ = _batch(q_lens, ctx_lens, hq, hkv, d, bs, dtype, gen, "cpu")
        mixed = _call(q, kc, vc, bt, q_lens, ctx_lens, scale, window, softcap, sinks)
        # the target alone, as an extend
        alone = _call(q[1:1 + n], kc, vc, bt[1:2], [n], [length], scale, window, softcap, sinks)
        for i in range(n):
            row, pos = 1 + i, length - n + i
            # a plain decode step of the target: alone, and batched with the other decode
            dec = _call(q[row:row + 1], kc, vc, bt[1:2], [1], [pos + 1], scale, window, softcap, sinks)
            dec2 = _call(torch.cat([q[0:1], q[row:row + 1]]), kc, vc, bt[0:2], [1, 1], [37, pos + 1], scale, window,
                         softcap, sinks)
            assert torch.equal(dec[0], dec2[1]), f"decode row depends on the batch (L={length}, query {i})"
            assert torch.equal(mixed[row], dec[0]), f"extend row {i} of {n} != decode row (context {pos + 1})"
            assert torch.equal(alone[i], dec[0]), f"lone extend row {i} of {n} != decode row (context {pos + 1})"
        # the other sequences' decode row too
        dec0 = _call(q[0:1], kc, vc, bt[0:1], [1], [37], scale, window, softcap, sinks)
        assert torch.equal(mixed[0], dec0[0])
        # and every extend row is right (against the reference), not merely consistent
        ref = attention.paged_attention_ref(q, kc, vc, bt, _cu(q_lens), torch.tensor(ctx_lens, dtype=torch.int32),
                                            max(q_lens), max(ctx_lens), scale, window, softcap, sinks)
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(mixed.float(), ref.float(), atol=tol, rtol=tol)


def _cu(q_lens):
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    return cu


# ---------------------------------------------------------------- linear layers

ROW_COUNTS = (1, 2, 3, 5, 6, 7, 17, 64)  # decode, every tail of a 4-row tile (verify k = 4: 5), a full batch
PROBE_ROWS = (0, 3, 4, 5, 16, 63)  # first/last of a tile, a tail row, the last row


def _assert_row_invariant(fn, x: torch.Tensor) -> None:
    """Row r of fn(X[:M]) equals row r of fn(X) for every M, and fn(X[r:r+1]) equals row r."""
    assert_rows_invariant(fn, x, ROW_COUNTS, PROBE_ROWS)


@needs_native
@pytest.mark.parametrize("act", ["f32", "q8"])
@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0", "Q4_1"])
@pytest.mark.parametrize("k,n", [(576, 200), (1536, 37)])
def test_ggml_matmul_rows_do_not_depend_on_m(qtype, act, k, n):
    from tokenfab.kernels.cpu.ggml_matmul import ggml_matmul
    from tokenfab.layers.ggml_linear import GGMLLinear

    gen = torch.Generator().manual_seed(k + n)
    nb = k // 32
    blocks = torch.randint(0, 256, (n, nb, {"Q8_0": 34, "Q4_0": 18, "Q4_1": 20}[qtype]), dtype=torch.uint8,
                           generator=gen)
    scales = (torch.rand(n, nb, 2, generator=gen) * 0.02).half().view(torch.uint8)  # finite d (and m)
    blocks[..., 0:2] = scales[..., 0:2]
    if qtype == "Q4_1":
        blocks[..., 2:4] = scales[..., 2:4]
    w = blocks.reshape(n, -1).contiguous()
    x = torch.randn(64, k, generator=gen)
    _assert_row_invariant(lambda xs: ggml_matmul(xs, w, qtype, k, act=act), x)
    layer = GGMLLinear(w, qtype, k, act=act)  # the layer's direct call of the C entry point
    _assert_row_invariant(layer, x)


@needs_native
@pytest.mark.parametrize("k,n,bias", [(576, 960, False), (1536, 576, True), (100, 37, True)])
def test_float32_linear_rows_do_not_depend_on_m_in_batch_invariant_mode(k, n, bias):
    gen = torch.Generator().manual_seed(k)
    w = torch.randn(n, k, generator=gen) * 0.05
    b = torch.randn(n, generator=gen) if bias else None
    x = torch.randn(64, k, generator=gen)
    packed = linear_mod.pack_weight(w)
    with linear_mod.batch_invariant_mode(True):
        for p in (packed, None):  # the MKL-packed layer and the unpacked one take the same kernel
            _assert_row_invariant(lambda xs, p=p: linear_mod.linear(xs, w, b, p), x)
        out = linear_mod.linear(x, w, b, packed)
        three_d = linear_mod.linear(x.view(4, 16, k), w, b, packed)
    assert torch.equal(three_d.view(64, n), out)
    ref = x.double() @ w.double().T + (b.double() if b is not None else 0)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


# ---------------------------------------------------------------- end to end (bundled model)


def _forward(runner, chunks):
    """One step over sequences given as (new token ids, first position, block table); logits of every row."""
    from tokenfab.forward_batch import ForwardBatch

    bs = runner.block_size
    ids, pos, slots, cu, ctx = [], [], [], [0], []
    width = max(len(t) for _, _, t in chunks)
    for toks, start, table in chunks:
        ids += toks
        pos += range(start, start + len(toks))
        slots += [table[p // bs] * bs + p % bs for p in range(start, start + len(toks))]
        cu.append(cu[-1] + len(toks))
        ctx.append(start + len(toks))
    batch = ForwardBatch(
        input_ids=torch.tensor(ids), positions=torch.tensor(pos), slot_mapping=torch.tensor(slots),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for _, _, t in chunks], dtype=torch.int32),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), context_lens=torch.tensor(ctx, dtype=torch.int32),
        logits_indices=torch.arange(len(ids)), max_query_len=max(len(c[0]) for c in chunks), max_context_len=max(ctx))
    return runner.forward_logits(batch)


@pytest.fixture(scope="module", params=["packed-q8_0", "float32-mkl"])
def bundled_runner(request):
    from tokenfab.engine.runner.model_runner import ModelRunner
    from tokenfab.loader.model_loader import load_model

    quant = None if request.param == "packed-q8_0" else "none"
    loaded = load_model(None, torch.float32, torch.device("cpu"), max_model_len=512, load_tokenizer=False,
                        quantization=quant)
    if quant == "none":
        assert linear_mod.prepack_cpu_linears(loaded.model) > 0 or not linear_mod.mkl_packing_available()
    return ModelRunner(loaded.model, torch.device("cpu"), torch.float32, block_size=16, num_blocks=64)


@needs_native
@pytest.mark.parametrize("k", [4])
def test_bundled_model_verify_logits_equal_decode_logits(bundled_runner, k):
    """A 70-token prefix (its last block partly filled), then k + 1 tokens: as k + 1 decode steps and
    as one extend, alone and with another sequence decoding beside it."""
    runner = bundled_runner
    rng = np.random.default_rng(0)
    prefix = rng.integers(100, 40000, 70).tolist()
    new = rng.integers(100, 40000, k + 1).tolist()
    other = rng.integers(100, 40000, 30).tolist()
    t_a, t_b = list(range(0, 6)), list(range(6, 9))  # block tables (16 tokens a block)
    with linear_mod.batch_invariant_mode(True), torch.inference_mode():
        _forward(runner, [(prefix, 0, t_a), (other, 0, t_b)])
        snapshot = runner.kv_cache.clone()
        decode = torch.cat([_forward(runner, [([tok], 70 + i, t_a)]) for i, tok in enumerate(new)])
        runner.kv_cache.copy_(snapshot)
        extend = _forward(runner, [(new, 70, t_a)])
        runner.kv_cache.copy_(snapshot)
        extend_mixed = _forward(runner, [([other[-1] + 1], 30, t_b), (new, 70, t_a)])[1:]
        runner.kv_cache.copy_(snapshot)
        decode_mixed = torch.cat([_forward(runner, [([other[-1] + 1], 30, t_b) if i == 0 else ([7], 30 + i, t_b),
                                                    ([tok], 70 + i, t_a)])[1:] for i, tok in enumerate(new)])
    assert extend.shape == decode.shape == (k + 1, runner.model.config.vocab_size)
    for name, got in (("extend", extend), ("extend beside a decode", extend_mixed), ("batched decode", decode_mixed)):
        bad = [i for i in range(k + 1) if not torch.equal(got[i], decode[i])]
        assert not bad, f"{name}: positions {bad} differ from plain decode (max {(got - decode).abs().max():.3g})"


# ---------------------------------------------------------------- the portable build

PORTABLE_CHECK = r"""
import json, sys, torch
sys.path.insert(0, sys.argv[1])
from tests.kernels.test_batch_invariance import _assert_row_invariant, _batch, _call
from tokenfab.kernels.cpu import native_library, ggml_matmul as gm
from tokenfab.layers import linear as L
assert native_library() is not None
gen = torch.Generator().manual_seed(0)
checked = 0
for hq, hkv, d in ((9, 3, 64), (6, 6, 40)):
    q_lens, ctx_lens = [1, 5, 40], [37, 65, 90]
    q, kc, vc, bt, _, _ = _batch(q_lens, ctx_lens, hq, hkv, d, 16, torch.float32, gen, "cpu")
    mixed = _call(q, kc, vc, bt, q_lens, ctx_lens, d**-0.5, 0, 0.0, None)
    for i in range(5):
        dec = _call(q[1 + i:2 + i], kc, vc, bt[1:2], [1], [61 + i], d**-0.5, 0, 0.0, None)
        assert torch.equal(mixed[1 + i], dec[0]), (hq, d, i)
        checked += 1
w = torch.randn(96, 576, generator=gen)
with L.batch_invariant_mode(True):
    _assert_row_invariant(lambda xs: L.linear(xs, w, None, None), torch.randn(64, 576, generator=gen))
print(json.dumps({"attention_rows": checked}))
"""


@needs_native
def test_portable_build_is_batch_invariant():
    """The plain x86-64-v2 build (compiler-vectorized loops, no AVX-512 intrinsics; the session's shared
    build, tests/kernels/native_builds.py) keeps the property."""
    out = run_python(PORTABLE, ["-c", PORTABLE_CHECK, ROOT], timeout=600)
    assert json.loads(out.strip().splitlines()[-1]) == {"attention_rows": 10}


# ---------------------------------------------------------------- the Triton path (interpreter on CPU)
# In batch-invariant mode (the engine's runner with speculation; here ``batch_invariant_mode``) the
# rows of an extend of <= 32 query rows run as decode rows through the split-KV decode kernel, whose
# split count is then fixed (a lone sequence's), so a row's bits depend only on its own keys.


def _op(q, kc, vc, bt, q_lens, ctx_lens, scale, window=0, softcap=0.0, sinks=None):
    """The engine's attention op (``tokenfab::paged_attention``), batch-invariant, Triton forced."""
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    with batch_invariant_mode(True):
        return torch.ops.tokenfab.paged_attention(q, kc, vc, bt, _cu(q_lens), ctx, max(q_lens), max(ctx_lens),
                                                  scale, window, softcap, sinks)


def _check_triton_rows(q_lens, ctx_lens, target, hq, hkv, d, bs, dtype, window, softcap, use_sinks, gen):
    """Sequence ``target`` of the batch is an extend; each of its rows must equal the decode row of
    its position, with the batch as given, alone, and as rows of a batched decode step."""
    scale = d**-0.5
    sinks = _sinks(use_sinks, hq, gen, "cpu")
    q, kc, vc, bt, _, _ = _batch(q_lens, ctx_lens, hq, hkv, d, bs, dtype, gen, "cpu")
    first, n, length = sum(q_lens[:target]), q_lens[target], ctx_lens[target]
    mixed = _op(q, kc, vc, bt, q_lens, ctx_lens, scale, window, softcap, sinks)
    alone = _op(q[first:first + n], kc, vc, bt[target:target + 1], [n], [length], scale, window, softcap, sinks)
    # a decode step of n sequences (the target at each of its n positions) and another sequence's decode
    other = 0 if target else 1
    dq = torch.cat([q[first:first + n], q[sum(q_lens[:other]) + q_lens[other] - 1:][:1]])
    dbt = torch.cat([bt[target:target + 1].expand(n, -1), bt[other:other + 1]])
    dctx = [length - n + i + 1 for i in range(n)] + [ctx_lens[other]]
    dec = _op(dq, kc, vc, dbt, [1] * (n + 1), dctx, scale, window, softcap, sinks)
    for i in (0, n - 1):  # decode rows do not depend on the batch either
        lone = _op(q[first + i:first + i + 1], kc, vc, bt[target:target + 1], [1], [dctx[i]], scale, window,
                   softcap, sinks)
        assert torch.equal(lone[0], dec[i]), f"decode row of context {dctx[i]} depends on the batch"
    for i in range(n):
        assert torch.equal(mixed[first + i], dec[i]), f"extend row {i} of {n} != decode row (context {dctx[i]})"
        assert torch.equal(alone[i], dec[i]), f"lone extend row {i} of {n} != decode row (context {dctx[i]})"
    # every row is right too (the reference), not merely consistent
    ref = attention.paged_attention_ref(q, kc, vc, bt, _cu(q_lens), torch.tensor(ctx_lens, dtype=torch.int32),
                                        max(q_lens), max(ctx_lens), scale, window, softcap, sinks)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(mixed.float(), ref.float(), atol=tol, rtol=tol)


def test_triton_extend_rows_equal_decode_rows(gen, monkeypatch):
    """The smoke case (fast tier): a 5-row verify beside a decode and a 33-token prefill chunk (the
    mixed path: prefill kernel + decode rows), GQA, float32."""
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    _check_triton_rows([1, 5, 33], [20, 40, 33], 1, 4, 2, 32, 16, torch.float32, 0, 0.0, False, gen)


TRITON_CASES = [
    # Hq, Hkv, D, block size, window, softcap, sinks, dtype
    (9, 3, 64, 16, 0, 0.0, False, torch.float32),  # the bundled model's shape (GQA 3)
    (8, 2, 32, 16, 0, 0.0, False, torch.bfloat16),
    (4, 1, 32, 32, 40, 30.0, True, torch.float32),  # MQA, sliding window, softcap, sinks
    (6, 6, 40, 16, 0, 0.0, False, torch.bfloat16),  # MHA, head dim not a power of two
]


# (case, n_q): every case at k + 1 = 5; 2 rows and the 32-row limit on two cases (the interpreter is slow)
TRITON_RUNS = [(c, 5) for c in TRITON_CASES] + [(TRITON_CASES[2], 2), (TRITON_CASES[1], 2), (TRITON_CASES[0], 32)]


@pytest.mark.slow  # ~3 min in the interpreter
@pytest.mark.parametrize("case,n_q", TRITON_RUNS, ids=[f"h{c[0]}-{c[1]}-d{c[2]}-w{c[4]}-{str(c[7])[6:]}-q{n}"
                                                         for c, n in TRITON_RUNS])
def test_triton_extend_rows_equal_decode_rows_all_cases(case, n_q, gen, monkeypatch):
    """Mirrors the CPU test: contexts n (the extend is the whole sequence), 65, 300; the target
    extend beside a decode, a prefill chunk of 40 and another extend (mixed path), and beside only
    short sequences (every row a decode row)."""
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    hq, hkv, d, bs, window, softcap, use_sinks, dtype = case
    for length in (n_q, 65, 300) if n_q < 32 else (65,):
        _check_triton_rows([1, n_q, 40, 3], [37, length, 90, 20], 1, hq, hkv, d, bs, dtype, window, softcap,
                           use_sinks, gen)
        _check_triton_rows([3, 1, n_q], [20, 37, length], 2, hq, hkv, d, bs, dtype, window, softcap, use_sinks,
                           gen)


def test_triton_split_count_is_fixed_in_batch_invariant_mode():
    """The decode kernel's split count: a lone sequence's for every batch size in the mode (so it is
    the same for a decode step and the decode rows of a verify), chosen from the batch outside it."""
    cfgs = [attention.decode_config(b, 32, 8, 128, 128, 132, invariant=True)["NUM_SPLITS"] for b in (1, 5, 64, 256)]
    assert cfgs == [attention.decode_config(1, 32, 8, 128, 128, 132, invariant=False)["NUM_SPLITS"]] * 4
    assert attention.decode_config(256, 32, 8, 128, 128, 132, invariant=False)["NUM_SPLITS"] < cfgs[0]
    with batch_invariant_mode(True):
        assert attention.decode_config(64, 32, 8, 128, 128, 132)["NUM_SPLITS"] == cfgs[0]


@pytest.mark.slow  # a few seconds: 8 and 32 splits in the interpreter
@pytest.mark.parametrize("sms", [2, 8])
def test_triton_rows_with_device_split_counts(sms, gen, monkeypatch):
    """With the split counts a GPU gets (here 2 / 8 SMs: 8 / 32 splits for 2 kv heads), including
    mostly empty splits and sinks merged by the reduce kernel."""
    from tokenfab.kernels import attention_decode

    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    monkeypatch.setattr(attention_decode, "num_sms", lambda dev: sms)
    _check_triton_rows([1, 5, 40], [37, 200, 90], 1, 4, 2, 32, 16, torch.float32, 0, 0.0, True, gen)
    _check_triton_rows([2, 4], [30, 100], 1, 4, 2, 32, 16, torch.bfloat16, 64, 20.0, False, gen)


@pytest.mark.slow  # ~10 s each in the interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_mla_verify_rows_equal_decode_rows(dtype, gen, monkeypatch):
    """MLA (DeepSeek MTP verify rows): a 3-row verify beside a decode and a prefill chunk equals
    the decode rows of its positions. The split count otherwise depends on the number of tokens
    (here 4 SMs: 4 splits for a 4-token decode step, 1 for the 14-token mixed step; 16 in the mode)."""
    from tests.kernels.test_mla import _batch as _mla_batch
    from tokenfab.kernels import mla

    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    monkeypatch.setattr(mla, "num_sms", lambda dev: 4)
    h, r, rope, n = 4, 32, 16, 3
    q_lens, ctx_lens = [1, n, 10], [30, 75, 40]
    q, cache, bt, cu, ctx = _mla_batch(q_lens, ctx_lens, h, r, rope, 16, dtype, gen, "cpu")
    scale = (r + rope) ** -0.5

    def op(q, bt, q_lens, ctx_lens):
        with batch_invariant_mode(True):
            ctx_t = torch.tensor(ctx_lens, dtype=torch.int32)
            return torch.ops.tokenfab.mla_attention(q, cache, bt, _cu(q_lens), ctx_t, max(q_lens), max(ctx_lens),
                                                    scale, r)

    mixed = op(q, bt, q_lens, ctx_lens)
    dctx = [75 - n + i + 1 for i in range(n)] + [30]
    dec = op(torch.cat([q[1:1 + n], q[0:1]]), torch.cat([bt[1:2].expand(n, -1), bt[0:1]]), [1] * (n + 1), dctx)
    lone = op(q[1:2], bt[1:2], [1], dctx[:1])
    assert torch.equal(lone[0], dec[0]), "MLA decode row depends on the batch"
    for i in range(n):
        assert torch.equal(mixed[1 + i], dec[i]), f"MLA verify row {i} != decode row (context {dctx[i]})"
    assert torch.equal(mixed[0], dec[n])
    ref = mla.mla_attention_ref(q, cache, bt, cu, ctx, max(q_lens), max(ctx_lens), scale, r)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(mixed.float(), ref.float(), atol=tol, rtol=tol)


@pytest.mark.slow  # ~20 s: two tiny models through every Triton kernel in the interpreter
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_triton_tiny_model_verify_logits_equal_decode_logits(model_type, tmp_path, monkeypatch):
    """End to end through the Triton kernels (interpreter) with the runner in batch-invariant mode:
    a tiny random model's logits for k + 1 = 4 tokens by decode steps equal one extend's, alone and
    beside another sequence's decode (linears: the invariant matmul; attention: decode rows)."""
    from tests.kernels.test_matmul_invariant import row_wise_interpreter_dot
    from tests.tiny_models import save_tiny_model, tiny_config
    from tokenfab.engine.runner.model_runner import ModelRunner
    from tokenfab.kernels import matmul_invariant
    from tokenfab.loader.model_loader import load_model

    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    row_wise_interpreter_dot(monkeypatch)
    calls = []
    orig = matmul_invariant._matmul_invariant_triton
    monkeypatch.setattr(matmul_invariant, "_matmul_invariant_triton", lambda *a, **k: calls.append(1) or orig(*a, **k))
    save_tiny_model(tiny_config(model_type), tmp_path)
    loaded = load_model(str(tmp_path), torch.float32, torch.device("cpu"), max_model_len=256, load_tokenizer=False)
    runner = ModelRunner(loaded.model, torch.device("cpu"), torch.float32, block_size=16, num_blocks=16)
    runner.batch_invariant = True
    rng = np.random.default_rng(1)
    prefix, new, other = (rng.integers(0, 320, n).tolist() for n in (37, 4, 20))
    t_a, t_b = [0, 1, 2], [3, 4]
    with torch.inference_mode():
        _forward(runner, [(prefix, 0, t_a), (other, 0, t_b)])
        snapshot = runner.kv_cache.clone()
        decode = torch.cat([_forward(runner, [([tok], 37 + i, t_a)]) for i, tok in enumerate(new)])
        runner.kv_cache.copy_(snapshot)
        extend = _forward(runner, [(new, 37, t_a)])
        runner.kv_cache.copy_(snapshot)
        mixed = _forward(runner, [([5], 20, t_b), (new, 37, t_a)])[1:]
    assert calls, "the invariant matmul did not run"
    for name, got in (("extend", extend), ("extend beside a decode", mixed)):
        bad = [i for i in range(4) if not torch.equal(got[i], decode[i])]
        assert not bad, f"{name}: positions {bad} differ from plain decode (max {(got - decode).abs().max():.3g})"


# ---------------------------------------------------------------- the switch belongs to the runner


class _ProbeModel(torch.nn.Module):
    """Records the batch-invariant mode its forward runs under; optionally waits on an event there."""

    def __init__(self, inside=None, release=None):
        super().__init__()
        self.seen, self.inside, self.release = [], inside, release

    def forward(self, batch):
        self.seen.append(linear_mod.batch_invariant())
        if self.inside is not None:
            self.inside.set()
            assert self.release.wait(10)
            self.seen.append(linear_mod.batch_invariant())
        return torch.zeros(1, 2)

    def compute_logits(self, hidden):
        return hidden


def _probe_runner(model, mode):
    from tokenfab.engine.runner.model_runner import ModelRunner

    runner = object.__new__(ModelRunner)  # the forward path only: no cache needed
    runner.model, runner.batch_invariant = model, mode
    return runner


def test_batch_invariant_mode_is_the_runners_own():
    """A runner's ``batch_invariant`` holds inside its own forwards only (None: the caller's mode),
    so two engines in one process do not change each other's numerics, even while both run at once
    in two threads (the engine's step thread)."""
    import threading
    from types import SimpleNamespace

    batch = SimpleNamespace(logits_indices=torch.zeros(1, dtype=torch.long))
    assert not linear_mod.batch_invariant()
    inside, release = threading.Event(), threading.Event()
    spec = _probe_runner(_ProbeModel(inside, release), True)  # an engine with speculation
    plain, inherit = _probe_runner(_ProbeModel(), False), _probe_runner(_ProbeModel(), None)
    worker = threading.Thread(target=spec.forward_logits, args=(batch,))
    worker.start()
    assert inside.wait(10)  # the speculative engine is inside its forward, in its thread
    plain.forward_logits(batch)
    inherit.forward_logits(batch)
    with batch_invariant_mode(True):
        plain.forward_logits(batch)
        inherit.forward_logits(batch)
        assert linear_mod.batch_invariant()
    release.set()
    worker.join(10)
    assert spec.model.seen == [True, True]
    assert plain.model.seen == [False, False]
    assert inherit.model.seen == [False, True]
    assert not linear_mod.batch_invariant()  # nothing leaked into the process
