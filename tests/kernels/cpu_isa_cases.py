"""Every native CPU kernel family on small fixed inputs, with its reference: what
``test_cpu_native_isa.py`` runs in each build of the library (AVX-512, AVX2, AVX2 + AVX-VNNI, scalar)
and compares across builds.

``python -m tests.kernels.cpu_isa_cases OUT`` writes ``{"info": cpu_kernel_info(), "cases": {name:
(kernel output, reference output)}}`` to OUT (torch.save) for the library this process builds
(``TOKENFAB_CPU_CFLAGS``, ``TOKENFAB_CACHE_DIR``). Inputs are seeded: every build sees the same ones.
"""

from __future__ import annotations

import sys

import torch

from tests.kernels.test_attention import _batch
from tokenfab.kernels import activation, attention, norm, quant, rope
from tokenfab.kernels.attention_ref import paged_attention_ref
from tokenfab.kernels.cpu import attention as na
from tokenfab.kernels.cpu import elementwise as ne
from tokenfab.kernels.cpu import ggml_matmul as gm
from tokenfab.kernels.cpu.fp8_matmul import fp8_dequant_native, fp8_linear_native
from tokenfab.kernels.cpu.info import cpu_kernel_info
from tokenfab.kernels.cpu.w4a16 import w4a16_native
from tokenfab.kernels.w4a16 import GROUP_SIZE, as_bytes, w4a16_gemm_ref

FP8 = torch.float8_e4m3fn
Cases = dict[str, tuple[torch.Tensor, torch.Tensor]]


def _fp8(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = (cache.float().abs().amax() / 448).reshape(1)
    return (cache.float() / scale).clamp(-448, 448).to(FP8), scale


def attention_cases(gen: torch.Generator) -> Cases:
    """Decode rows (16-key dot tiles, a head dim off the 16-lane grid, MLA's 576/512 shape), a mixed
    batch with a long prefill chunk (the online-softmax blocks) and a short extend, softcap, window and
    sinks; float32, bfloat16 and e4m3 caches."""
    out: Cases = {}
    shapes = {"gqa": (8, 2, 64, 64), "d20": (6, 3, 20, 20), "mla": (4, 1, 576, 512), "d80": (4, 2, 80, 80)}
    for dtype in (torch.float32, torch.bfloat16):
        dn = "f32" if dtype == torch.float32 else "bf16"
        for sname, (hq, hkv, d, dv) in shapes.items():
            q, kc, vc, bt, _, ctx = _batch([1] * 4, [1, 16, 17, 90], hq, hkv, d, 16, dtype, gen, "cpu", dv=dv)
            sinks = torch.randn(hq, generator=gen)
            out[f"attn_decode_{sname}_{dn}"] = (
                na.paged_decode_attention_native(q, kc, vc, bt, ctx, d**-0.5, 0, 20.0, sinks),
                attention.paged_decode_attention_ref(q, kc, vc, bt, ctx, 90, d**-0.5, 0, 20.0, sinks))
            q, kc, vc, bt, cu, ctx = _batch([1, 70, 3], [9, 80, 40], hq, hkv, d, 16, dtype, gen, "cpu", dv=dv)
            out[f"attn_mixed_{sname}_{dn}"] = (na.paged_attention_native(q, kc, vc, bt, cu, ctx, 0.2, 30),
                                                paged_attention_ref(q, kc, vc, bt, cu, ctx, 70, 80, 0.2, 30))
            if sname in ("gqa", "d20"):
                k8, ks = _fp8(kc)
                v8, vs = _fp8(vc)
                out[f"attn_fp8kv_{sname}_{dn}"] = (
                    na.paged_attention_native(q, k8, v8, bt, cu, ctx, 0.2, k_scale=ks, v_scale=vs),
                    paged_attention_ref(q, (k8.float() * ks).to(dtype), (v8.float() * vs).to(dtype), bt, cu, ctx,
                                        70, 80, 0.2))
    return out


def elementwise_cases(gen: torch.Generator) -> Cases:
    out: Cases = {}
    for dtype in (torch.float32, torch.bfloat16):
        dn = "f32" if dtype == torch.float32 else "bf16"
        x = torch.randn(33, 200, generator=gen).to(dtype)
        res = torch.randn(33, 200, generator=gen).to(dtype)
        w = torch.randn(200, generator=gen).to(dtype)
        out[f"rms_norm_{dn}"] = (ne.rms_norm(x, w, 1e-6), norm.rms_norm_ref(x, w, 1e-6))
        got_r, want_r = res.clone(), res.clone()
        got = ne.add_rms_norm(x, got_r, w, 1e-6)
        want = norm.add_rms_norm_ref(x, want_r, w, 1e-6)
        out[f"add_rms_norm_{dn}"] = (torch.cat([got.flatten(), got_r.flatten()]),
                                     torch.cat([want.flatten(), want_r.flatten()]))
        out[f"silu_and_mul_{dn}"] = (ne.silu_and_mul(x), activation.silu_and_mul_ref(x))
        qk = torch.randn(5, 4, 40, generator=gen).to(dtype)
        pos = torch.tensor([0, 3, 7, 1, 9])
        cs = torch.randn(10, 32, generator=gen)
        for neox in (True, False):
            got = torch.cat([t.flatten() for t in ne.rotary_embedding(pos, qk, qk, cs, neox)])
            want = torch.cat([t.flatten() for t in rope.rotary_embedding_ref(pos, qk, qk, cs, neox)])
            out[f"rope_{'neox' if neox else 'gptj'}_{dn}"] = (got, want)
    logits = torch.randn(4, 333, generator=gen)
    out["argmax"] = (ne.argmax(logits), logits.argmax(-1))
    return out


def _w4_weight(codec: str, n: int, k: int, gen: torch.Generator):
    groups = -(-k // GROUP_SIZE[codec])
    q = torch.randint(0, 256, (n, (k + 1) // 2), generator=gen, dtype=torch.int64).to(torch.uint8)
    if codec == "int4":
        return q, (torch.rand(n, groups, generator=gen) * 0.02 + 0.005).half(), None
    if codec == "mxfp4":
        return q, torch.randint(120, 126, (n, groups), generator=gen, dtype=torch.int64).to(torch.uint8), None
    return q, (torch.rand(n, groups, generator=gen) * 3 + 0.25).to(FP8), torch.tensor(0.0125)


def _ggml_weight(qtype: str, m: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """x [m, 576] and a packed weight [45, row bytes] with small scales (Q4_1: negative offsets)."""
    w = torch.randint(0, 256, (45, 18, gm.BLOCK_BYTES[qtype]), dtype=torch.uint8, generator=gen)
    w[..., 0:2] = (torch.rand(45, 18, 1, generator=gen) * 0.01).half().view(torch.uint8)
    if qtype == "Q4_1":
        w[..., 2:4] = (-torch.rand(45, 18, 1, generator=gen) * 0.05).half().view(torch.uint8)
    return torch.randn(m, 576, generator=gen), w.reshape(45, -1)


def quant_cases(gen: torch.Generator) -> Cases:
    """W4A16 (int4 with float16 scales, MXFP4, NVFP4; float32 and bfloat16 activations; a ragged K),
    FP8 weights, and the packed GGUF matmuls (float32 and int8 activations) with their row lookup."""
    out: Cases = {}
    for codec in ("int4", "mxfp4", "nvfp4"):
        for dtype in (torch.float32, torch.bfloat16):
            for k in (256, 200):
                q, s, gs = _w4_weight(codec, 24, k, gen)
                x = torch.randn(3, k, generator=gen).to(dtype)
                bias = torch.randn(24, generator=gen).to(dtype)
                out[f"w4a16_{codec}_{str(dtype)[6:]}_k{k}"] = (
                    w4a16_native(x, as_bytes(q), s, gs, bias, codec, k),
                    w4a16_gemm_ref(x, as_bytes(q), s, gs, bias, codec, k))
    for group_n, (n, k) in ((128, (150, 300)), (1, (40, 129))):
        w = (torch.randn(n, k, generator=gen) * 50).clamp(-448, 448).to(FP8)
        s = torch.rand(-(-n // 128) if group_n == 128 else n, -(-k // 128), generator=gen) * 0.01
        x = torch.randn(3, k, generator=gen)
        ref_w = quant.dequantize_fp8(w, s, group_n, torch.float32)
        out[f"fp8_matmul_g{group_n}"] = (fp8_linear_native(x, w, s, group_n, None), x @ ref_w.T)
        out[f"fp8_dequant_g{group_n}"] = (fp8_dequant_native(w, s, group_n), ref_w)
    for qtype in gm.BLOCK_BYTES:
        for m in (1, 3, 9):
            x, w = _ggml_weight(qtype, m, gen)
            for act in ("f32", "q8"):
                out[f"ggml_{act}_{qtype}_m{m}"] = (gm.ggml_matmul(x, w, qtype, 576, act=act),
                                                   gm.ggml_matmul_reference(x, w, qtype, 576, act=act))
        rows = torch.tensor([0, 44, 7])
        out[f"ggml_rows_{qtype}"] = (gm.ggml_dequantize_rows(w, qtype, 576, rows),
                                     gm.ggml_dequantize_rows_reference(w, qtype, 576, rows))
    return out


def run_cases() -> dict:
    gen = torch.Generator().manual_seed(26)
    cases = {**attention_cases(gen), **elementwise_cases(gen), **quant_cases(gen)}
    return {"info": cpu_kernel_info(), "cases": cases}


if __name__ == "__main__":
    torch.save(run_cases(), sys.argv[1])
    print("cases written")
