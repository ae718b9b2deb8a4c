"""W4A16 GEMM (tokenfab/kernels/w4a16.py): the Triton kernel (interpreter on CPU) against the
reference, for the three codecs, and the reference's dequantization against plain definitions of
each format (int32 words unpacked by shifts, the E2M1 table, 2^(s-127), float8_e4m3fn)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.tolerances import assert_close
from tokenfab.kernels import w4a16
from tokenfab.kernels.w4a16 import FP4_E2M1_VALUES, GROUP_SIZE, as_bytes, dequantize_w4, w4a16_gemm_ref


def make_weight(codec: str, n: int, k: int, gen: torch.Generator):
    """Random packed weight of ``codec`` in its checkpoint dtypes: (qweight, scales, global scale)."""
    g = GROUP_SIZE[codec]
    groups = (k + g - 1) // g
    if codec == "int4":
        words = torch.randint(-(2**31), 2**31 - 1, (n, (k + 7) // 8), generator=gen, dtype=torch.int64)
        q = words.to(torch.int32)
        s = (torch.rand(n, groups, generator=gen) * 0.02 + 0.005).to(torch.bfloat16)
        return q, s, None
    q = torch.randint(0, 256, (n, (k + 1) // 2), generator=gen, dtype=torch.int64).to(torch.uint8)
    if codec == "mxfp4":
        return q, torch.randint(120, 126, (n, groups), generator=gen, dtype=torch.int64).to(torch.uint8), None
    s = (torch.rand(n, groups, generator=gen) * 3 + 0.25).to(torch.float8_e4m3fn)
    return q, s, torch.tensor(0.0125)


def plain_dequant(codec: str, q: torch.Tensor, s: torch.Tensor, k: int) -> torch.Tensor:
    """The formats' definitions, written independently of the kernel module's byte view."""
    n = q.shape[0]
    out = torch.empty(n, k)
    for row in range(n):
        for col in range(k):
            if codec == "int4":
                nib = (int(q[row, col // 8]) >> (4 * (col % 8))) & 0xF
                out[row, col] = (nib - 8) * float(s[row, col // 32])
            else:
                byte = int(q[row, col // 2])
                nib = byte & 0xF if col % 2 == 0 else byte >> 4
                if codec == "mxfp4":
                    scale = 2.0 ** (int(s[row, col // 32]) - 127)
                else:
                    scale = float(s[row, col // 16].float())
                out[row, col] = FP4_E2M1_VALUES[nib] * scale
    return out


@pytest.mark.parametrize("codec", ["int4", "mxfp4", "nvfp4"])
def test_dequantize_matches_format_definition(codec, gen):
    k = 80 if codec != "int4" else 96
    q, s, _ = make_weight(codec, 5, k, gen)
    got = dequantize_w4(as_bytes(q), s, codec, k)
    torch.testing.assert_close(got, plain_dequant(codec, q, s, k), rtol=0, atol=0)


def test_mxfp4_matches_gpt_oss_dequantizer(gen):
    from tokenfab.models.gpt_oss import dequantize_mxfp4

    q, s, _ = make_weight("mxfp4", 6, 96, gen)
    blocks = q.view(6, 3, 16)
    torch.testing.assert_close(dequantize_w4(q, s, "mxfp4", 96), dequantize_mxfp4(blocks, s, torch.float32))


def test_bad_shapes_are_clear_errors(gen):
    q, s, _ = make_weight("int4", 4, 64, gen)
    with pytest.raises(ValueError, match="scales must be"):
        dequantize_w4(as_bytes(q), s[:, :1], "int4", 64)
    with pytest.raises(ValueError, match="codec"):
        dequantize_w4(as_bytes(q), s, "int3", 64)
    with pytest.raises(ValueError, match="uint8"):
        dequantize_w4(as_bytes(q), s, "int4", 128)


CASES = [
    # (rows, N, K): one token, K not a multiple of the tile, many tokens, a ragged N
    (1, 64, 256),
    (3, 48, 160),
    (37, 96, 96),
    (130, 40, 192),
    (2, 24, 80),  # no K tile divides K: the masked-K path
]


@pytest.mark.parametrize("codec", ["int4", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", CASES)
def test_triton_matches_reference(codec, dtype, m, n, k, device, gen):
    q, s, gs = make_weight(codec, n, k, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if m % 2 else None
    qb = as_bytes(q)
    want = w4a16_gemm_ref(x, qb, s, gs, bias, codec, k)
    dev = [t.to(device) if t is not None else None for t in (x, qb, s, gs, bias)]
    got = w4a16._w4a16_gemm_triton(*dev, codec, k)
    assert_close(got, want.to(device))


def test_fp16_and_3d_input(device, gen):
    q, s, _ = make_weight("int4", 64, 128, gen)
    x = torch.randn(2, 5, 128, generator=gen).half()
    want = w4a16_gemm_ref(x, as_bytes(q), s.half(), None, None, "int4", 128)
    got = w4a16._w4a16_gemm_triton(x.to(device), as_bytes(q).to(device), s.half().to(device), None, None, "int4", 128)
    assert got.shape == (2, 5, 64)
    assert_close(got, want.to(device))


def test_reference_is_the_dequantized_matmul(gen):
    """The reference equals x @ dequant(W)^T in fp32 (fp32 activations: no rounding of W)."""
    q, s, gs = make_weight("nvfp4", 32, 64, gen)
    x = torch.randn(4, 64, generator=gen)
    want = x @ (plain_dequant("nvfp4", q, s, 64) * 0.0125).T
    torch.testing.assert_close(w4a16_gemm_ref(x, q, s, gs, None, "nvfp4", 64), want, rtol=1e-5, atol=1e-5)


def test_custom_op_and_zero_rows(device, gen):
    q, s, _ = make_weight("mxfp4", 32, 64, gen)
    x = torch.randn(0, 64).to(device)
    out = torch.ops.tokenfab.w4a16_gemm(x, q.to(device), s.to(device), None, None, "mxfp4", 64)
    assert out.shape == (0, 32)
    x = torch.randn(2, 64, generator=gen)
    out = torch.ops.tokenfab.w4a16_gemm(x, q, s, None, None, "mxfp4", 64)
    assert_close(out, w4a16_gemm_ref(x, q, s, None, None, "mxfp4", 64))


def test_per_row_global_scale(device, gen):
    """A merged NVFP4 projection: each output row has its shard's global scale."""
    q, s, _ = make_weight("nvfp4", 48, 64, gen)
    gs = torch.cat([torch.full((16,), 0.01), torch.full((32,), 0.03)])
    x = torch.randn(5, 64, generator=gen).bfloat16()
    want = w4a16_gemm_ref(x, q, s, gs, None, "nvfp4", 64)
    split = torch.cat([w4a16_gemm_ref(x, q[:16], s[:16], gs[:1], None, "nvfp4", 64),
                       w4a16_gemm_ref(x, q[16:], s[16:], gs[16:17], None, "nvfp4", 64)], dim=1)
    torch.testing.assert_close(want, split)
    got = w4a16._w4a16_gemm_triton(x.to(device), q.to(device), s.to(device), gs.to(device), None, "nvfp4", 64)
    assert_close(got, want.to(device))


# ----------------------------------------------------------------------------- the C kernel (CPU)


@pytest.mark.parametrize("codec", ["int4", "mxfp4", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k", CASES)
def test_native_matches_reference(codec, dtype, m, n, k, gen):
    from tokenfab.kernels.cpu import native_library
    from tokenfab.kernels.cpu.w4a16 import w4a16_native

    if native_library() is None:
        pytest.skip("no C compiler: the reference is the CPU path")
    q, s, gs = make_weight(codec, n, k, gen)
    x = torch.randn(m, k, generator=gen).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype)
    got = w4a16_native(x, as_bytes(q), s, gs, bias, codec, k)
    assert_close(got, w4a16_gemm_ref(x, as_bytes(q), s, gs, bias, codec, k))


def test_native_odd_k(gen):
    """NVFP4 rows of odd K (the last byte's high nibble unused)."""
    from tokenfab.kernels.cpu import native_library
    from tokenfab.kernels.cpu.w4a16 import w4a16_native

    if native_library() is None:
        pytest.skip("no C compiler: the reference is the CPU path")
    q, s, gs = make_weight("nvfp4", 8, 81, gen)
    x = torch.randn(2, 81, generator=gen)
    assert_close(w4a16_native(x, q, s, gs, None, "nvfp4", 81), w4a16_gemm_ref(x, q, s, gs, None, "nvfp4", 81))


def test_native_declines_what_it_cannot_take(gen, monkeypatch):
    from tokenfab.kernels.cpu.w4a16 import w4a16_native

    q, s, _ = make_weight("int4", 16, 64, gen)
    x = torch.randn(2, 64, generator=gen)
    assert w4a16_native(x.half(), as_bytes(q), s, None, None, "int4", 64) is None  # fp16 activations
    assert w4a16_native(x, as_bytes(q), s[:, :1], None, None, "int4", 64) is None  # bad scales: ref raises
    monkeypatch.setenv("TOKENFAB_CPU_NATIVE", "0")
    assert w4a16_native(x, as_bytes(q), s, None, None, "int4", 64) is None


@pytest.mark.parametrize("codec", ["int4", "nvfp4"])
@pytest.mark.parametrize("split", [3, 4])  # 5 K tiles: uneven splits; with 4, the last split is empty
def test_split_k_decode(codec, split, device, gen):
    q, s, gs = make_weight(codec, 40, 640 - 16, gen)
    x = torch.randn(3, 624, generator=gen).bfloat16()
    bias = torch.randn(40, generator=gen).bfloat16()
    want = w4a16_gemm_ref(x, as_bytes(q), s, gs, bias, codec, 624)
    dev = [t.to(device) if t is not None else None for t in (x, as_bytes(q), s, gs, bias)]
    got = w4a16._w4a16_gemm_triton(*dev, codec, 624, config=dict(SPLIT_K=split))
    assert_close(got, want.to(device))


def test_decode_config_splits_k_on_a_big_gpu():
    cfg = w4a16.w4a16_config(1, 4096, 14336, torch.bfloat16, sms=132)
    assert cfg["BLOCK_M"] == 16 and cfg["SPLIT_K"] == 5  # 128 column tiles: ~4 programs per SM
    assert w4a16.w4a16_config(16, 4096, 14336, torch.bfloat16, sms=132) == cfg  # batch-independent
    assert w4a16.w4a16_config(1, 4096, 256, torch.bfloat16, sms=132)["SPLIT_K"] == 1  # K too short
    assert w4a16.w4a16_config(4096, 4096, 14336, torch.bfloat16)["SPLIT_K"] == 1


def test_even_block_k():
    assert w4a16.even_block_k(128, 2880, 32) == 64  # GPT-OSS hidden: 64-wide tiles need no K mask
    assert w4a16.even_block_k(128, 14336, 32) == 128
    assert w4a16.even_block_k(128, 160, 32) == 32
    assert w4a16.even_block_k(128, 80, 16) == 128  # nothing divides: keep the tile, mask K


@pytest.mark.parametrize("codec", ["int4", "nvfp4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_prefill_tiles(codec, dtype, gen, monkeypatch):
    """Above GEMV_MAX_ROWS rows the C kernel dequantizes tiles of weight rows (7 here: a ragged last
    tile) for torch's GEMM; the result is the reference's."""
    from tokenfab.kernels.cpu import native_library
    from tokenfab.kernels.cpu import w4a16 as cw

    if native_library() is None:
        pytest.skip("no C compiler: the reference is the CPU path")
    monkeypatch.setattr(cw, "TILE_BYTES", 4 * 96 * 7)
    q, s, gs = make_weight(codec, 40, 96, gen)
    gs = torch.linspace(0.01, 0.02, 40) if codec == "nvfp4" else None  # per-row global scales
    x = torch.randn(cw.GEMV_MAX_ROWS + 5, 96, generator=gen).to(dtype)
    bias = torch.randn(40, generator=gen).to(dtype)
    got = cw.w4a16_native(x, as_bytes(q), s, gs, bias, codec, 96)
    assert_close(got, w4a16_gemm_ref(x, as_bytes(q), s, gs, bias, codec, 96))
