"""Compile every Triton kernel for Hopper (sm_90) without a GPU, at the dispatcher's configs.

ARCHITECTURE.md, kernel rule 5. Each workload below calls an op's ``_..._triton`` launcher with
CPU tensors of realistic shapes; ``hopper_harness.py`` compiles its launches instead of running them
and reads registers, shared/local memory and the SASS. Run as a script with TRITON_INTERPRET=0 (the
compiler needs real @triton.jit functions; unset, tokenfab.kernels selects the interpreter on a
machine without a GPU):
    TRITON_INTERPRET=0 python tests/kernels/hopper_compile.py --json out.json --markdown
``tests/kernels/test_hopper_compile.py`` runs it in a subprocess and checks the results.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.kernels.hopper_harness import BF16, F32, FP8, ON_REQUEST, compile_workloads, run_cli  # noqa: E402

# --------------------------------------------------------------------------- workloads

def _paged(b: int, hq: int, hkv: int, d: int, ctx: int, dtype: torch.dtype, bs: int = 16, q_len: int = 1):
    nblk = (ctx + bs - 1) // bs
    kc = torch.randn(b * nblk + 1, bs, hkv, d, dtype=dtype)
    vc = torch.randn_like(kc)
    bt = torch.arange(b * nblk, dtype=torch.int32).view(b, nblk)
    q = torch.randn(b * q_len, hq, d, dtype=dtype)
    cu = torch.arange(0, b * q_len + 1, q_len, dtype=torch.int32)
    lens = torch.full((b,), ctx, dtype=torch.int32)
    return q, kc, vc, bt, cu, lens


def _workloads() -> list[tuple[str, Callable[[], None]]]:
    from tokenfab.kernels import activation, attention, kv_cache, lora, norm, rope, sampling

    def rms(t, h, dtype, residual=False):
        x = torch.randn(t, h, dtype=dtype)
        w = torch.randn(h, dtype=dtype)
        if residual:
            norm._add_rms_norm_triton(x, torch.randn_like(x), w, 1e-6)
        else:
            norm._rms_norm_triton(x, w, 1e-6)

    def qk_norm():
        qkv = torch.randn(37, (32 + 2 * 8) * 128, dtype=BF16)
        norm._rms_norm_triton(qkv[:, : 32 * 128].view(37, 32, 128), torch.randn(128, dtype=BF16), 1e-6)

    def rot(hq, hk, d, r, neox, dtype):
        cs = torch.randn(4096, r, dtype=F32)
        rope._rotary_embedding_triton(torch.arange(37), torch.randn(37, hq, d, dtype=dtype),
                                      torch.randn(37, hk, d, dtype=dtype), cs, neox)

    def store(hkv, d, dtype, cache_dtype):
        kc = torch.zeros(64, 16, hkv, d, dtype=cache_dtype)
        scale = torch.ones(1) if cache_dtype == FP8 else None
        kv_cache._store_kv_triton(torch.randn(37, hkv, d, dtype=dtype), torch.randn(37, hkv, d, dtype=dtype),
                                  kc, torch.zeros_like(kc), torch.arange(37), scale, scale)

    def fp8_cache(args):
        """The paged batch with its caches as fp8 (contents unused: only the dtypes matter), and scales."""
        q, kc, vc, *rest = args
        return (q, kc.to(FP8), vc.to(FP8), *rest), torch.ones(1), torch.ones(1)

    def decode(b, hq, hkv, d, dtype, window=0, softcap=0.0, sinks=False, fp8=False):
        batch, ks, vs = fp8_cache(_paged(b, hq, hkv, d, 48, dtype)) if fp8 else (_paged(b, hq, hkv, d, 48, dtype),
                                                                                 None, None)
        q, kc, vc, bt, _, lens = batch
        sk = torch.randn(hq) if sinks else None
        attention._paged_decode_attention_triton(q, kc, vc, bt, lens, 48, d**-0.5, window, softcap, sk, ks, vs)

    def prefill(b, q_len, hq, hkv, d, dtype, window=0, softcap=0.0, sinks=False, fp8=False):
        batch = _paged(b, hq, hkv, d, q_len, dtype, q_len=q_len)
        batch, ks, vs = fp8_cache(batch) if fp8 else (batch, None, None)
        q, kc, vc, bt, cu, lens = batch
        sk = torch.randn(hq) if sinks else None
        attention._prefill_attention_triton(q, kc, vc, bt, cu, lens, q_len, q_len, d**-0.5, window, softcap,
                                            sk, ks, vs)

    def flce_rows(c, v, dtype, smoothing=0.0, z=0.0):
        from tokenfab.kernels import loss

        loss._ce_chunk_triton(torch.empty(c, v, dtype=dtype), torch.zeros(c, dtype=torch.long), torch.ones(1), -100,
                              smoothing, z)

    def grouped_train(t, e, n, k, dtype):
        from tokenfab.kernels import moe_train

        counts = torch.full((e,), t // e)
        x, w, dy = torch.empty(t, k, dtype=dtype), torch.empty(e, n, k, dtype=dtype), torch.empty(t, n, dtype=dtype)
        moe_train._grouped_mm_triton(x, w, counts, transpose_w=True)
        moe_train._grouped_mm_triton(dy, w, counts, transpose_w=False)
        moe_train._grouped_wgrad_triton(dy, x, counts, e)

    def norm_train(t, h, dtype, residual, offset=0.0):
        from tokenfab.kernels import norm_train as nt

        x, w = torch.empty(t, h, dtype=dtype), torch.empty(h, dtype=dtype)
        r = torch.empty_like(x) if residual else None
        nt._rms_norm_train_fwd_triton(x, w, r, 1e-6, offset)
        nt._rms_norm_train_bwd_triton(x, r, x, w, torch.empty(t), offset)

    def rope_train(b, hq, hk, t, d, dtype):
        from tokenfab.kernels import rope_train as rt

        cs = torch.empty(b, t, d, dtype=dtype)
        for h in (hq, hk):
            x = torch.empty(b, t, h, d, dtype=dtype).transpose(1, 2)  # HF's layout
            rt._rope_train_triton(x, cs, cs, False)
            rt._rope_train_triton(x, cs, cs, True)

    def act_train(t, i, dtype, act):
        from tokenfab.kernels import activation_train as at

        g = torch.empty(t, i, dtype=dtype)
        at._act_fwd_triton(g, g, act)
        at._act_bwd_triton(g, g, g, act)

    def samp(b, v, dtype):
        sampling._sample_triton(torch.randn(b, v, dtype=dtype), torch.ones(b), torch.full((b,), 50),
                                torch.full((b,), 0.9), torch.zeros(b), torch.arange(b))

    def lora_delta(t, k, n, r, s, dtype):  # multi-LoRA's gathered shrink/expand
        lora._lora_delta_triton(torch.randn(t, k, dtype=dtype), torch.randint(-1, s, (t,), dtype=torch.int32),
                                torch.randn(s, r, k, dtype=dtype), torch.randn(s, n, r, dtype=dtype))

    return [
        ("rms_norm bf16 [257, 4096]", lambda: rms(257, 4096, BF16)),
        ("rms_norm bf16 [257, 1024]", lambda: rms(257, 1024, BF16)),
        ("rms_norm fp32 [257, 576]", lambda: rms(257, 576, F32)),
        ("rms_norm bf16 [37, 16384] (chunked)", lambda: rms(37, 16384 + 512, BF16)),
        ("rms_norm bf16 q-norm [37, 32, 128] strided", qk_norm),
        ("add_rms_norm bf16 [257, 4096]", lambda: rms(257, 4096, BF16, residual=True)),
        ("add_rms_norm fp32 [257, 576]", lambda: rms(257, 576, F32, residual=True)),
        ("rotary neox bf16 32/8 heads d128", lambda: rot(32, 8, 128, 128, True, BF16)),
        ("rotary gptj bf16 32/8 heads d128 rot64", lambda: rot(32, 8, 128, 64, False, BF16)),
        ("rotary neox fp32 9/3 heads d64", lambda: rot(9, 3, 64, 64, True, F32)),
        ("silu_and_mul bf16 [257, 2x14336]", lambda: activation._silu_and_mul_triton(
            torch.randn(257, 2 * 14336, dtype=BF16))),
        ("silu_and_mul fp32 [257, 2x1536]", lambda: activation._silu_and_mul_triton(
            torch.randn(257, 2 * 1536, dtype=F32))),
        ("gelu_and_mul bf16 tanh [257, 2x9216]", lambda: activation._gelu_and_mul_triton(
            torch.randn(257, 2 * 9216, dtype=BF16), "tanh")),
        ("gelu_and_mul bf16 erf [257, 2x9216]", lambda: activation._gelu_and_mul_triton(
            torch.randn(257, 2 * 9216, dtype=BF16), "none")),
        ("store_kv bf16 8 heads d128", lambda: store(8, 128, BF16, BF16)),
        ("store_kv fp32->bf16 3 heads d64", lambda: store(3, 64, F32, BF16)),
        ("store_kv fp8-kv bf16 in, 8 heads d128", lambda: store(8, 128, BF16, FP8)),
        ("decode bf16 B64 32/8 d128 (split)", lambda: decode(64, 32, 8, 128, BF16)),
        ("decode bf16 B256 32/8 d128 (1 split)", lambda: decode(256, 32, 8, 128, BF16)),
        ("decode bf16 B1 16/8 d128 (32 splits)", lambda: decode(1, 16, 8, 128, BF16)),
        ("decode bf16 B64 64/8 d64 window+sinks", lambda: decode(64, 64, 8, 64, BF16, 128, 0.0, True)),
        ("decode bf16 B64 8/4 d256 softcap", lambda: decode(64, 8, 4, 256, BF16, 4096, 50.0)),
        ("decode fp32 B8 9/3 d64", lambda: decode(8, 9, 3, 64, F32)),
        ("decode bf16 fp8-kv B64 32/8 d128 (split)", lambda: decode(64, 32, 8, 128, BF16, fp8=True)),
        ("decode bf16 fp8-kv B256 32/8 d128 (1 split)", lambda: decode(256, 32, 8, 128, BF16, fp8=True)),
        ("decode bf16 fp8-kv B64 64/8 d64 window+sinks", lambda: decode(64, 64, 8, 64, BF16, 128, 0.0, True, True)),
        ("decode bf16 fp8-kv B64 8/4 d256 softcap", lambda: decode(64, 8, 4, 256, BF16, 4096, 50.0, fp8=True)),
        ("prefill bf16 32/8 d128", lambda: prefill(3, 100, 32, 8, 128, BF16)),
        ("prefill bf16 16/16 d128 (MHA)", lambda: prefill(3, 100, 16, 16, 128, BF16)),
        ("prefill bf16 28/4 d128 (group 7)", lambda: prefill(3, 100, 28, 4, 128, BF16)),
        ("prefill bf16 64/8 d64 window+sinks", lambda: prefill(3, 100, 64, 8, 64, BF16, 128, 0.0, True)),
        ("prefill bf16 8/4 d256 softcap+window", lambda: prefill(3, 100, 8, 4, 256, BF16, 4096, 50.0)),
        ("prefill fp32 9/3 d64", lambda: prefill(3, 100, 9, 3, 64, F32)),
        ("prefill bf16 fp8-kv 32/8 d128", lambda: prefill(3, 100, 32, 8, 128, BF16, fp8=True)),
        ("prefill bf16 fp8-kv 64/8 d64 window+sinks", lambda: prefill(3, 100, 64, 8, 64, BF16, 128, 0.0, True, True)),
        ("prefill bf16 fp8-kv 8/4 d256 softcap+window",
         lambda: prefill(3, 100, 8, 4, 256, BF16, 4096, 50.0, fp8=True)),
        ("prefill fp32 32/8 d128", lambda: prefill(3, 100, 32, 8, 128, F32)),
        ("decode fp32 B8 32/8 d128", lambda: decode(8, 32, 8, 128, F32)),
        ("sample fp32 [64, 151936]", lambda: samp(64, 151936, F32)),
        ("sample bf16 [8, 49152]", lambda: samp(8, 49152, BF16)),
        ("flce rows bf16 [64, 49152]", lambda: flce_rows(64, 49152, BF16)),
        ("flce rows bf16 [2048, 128256] smoothing+z", lambda: flce_rows(2048, 128256, BF16, 0.1, 1e-4)),
        ("flce rows fp32 [64, 49152]", lambda: flce_rows(64, 49152, F32)),
        ("grouped gemm train bf16 qwen3-30b-a3b gate_up T=8192x8", lambda: grouped_train(65536, 128, 1536, 2048, BF16)),
        ("grouped gemm train bf16 qwen3-30b-a3b down T=8192x8", lambda: grouped_train(65536, 128, 2048, 768, BF16)),
        ("grouped gemm train fp32 [4096, 8 experts] 576x1536", lambda: grouped_train(4096, 8, 1536, 576, F32)),
        ("rms_norm_train bf16 [8192, 4096] +residual", lambda: norm_train(8192, 4096, BF16, True)),
        ("rms_norm_train bf16 [8192, 2304] gemma", lambda: norm_train(8192, 2304, BF16, False, 1.0)),
        ("rms_norm_train bf16 [2048, 16384] (largest row)", lambda: norm_train(2048, 16384, BF16, True)),
        ("rms_norm_train fp32 [2048, 576] +residual", lambda: norm_train(2048, 576, F32, True)),
        ("rms_norm_train bf16 qk-norm [8192x32, 128]", lambda: norm_train(8192 * 32, 128, BF16, False)),
        ("rope_train bf16 B4 T2048 32/8 heads d128", lambda: rope_train(4, 32, 8, 2048, 128, BF16)),
        ("rope_train fp32 B2 T512 9/3 heads d64", lambda: rope_train(2, 9, 3, 512, 64, F32)),
        ("silu_and_mul_train bf16 [8192, 14336]", lambda: act_train(8192, 14336, BF16, "silu")),
        ("gelu_and_mul_train bf16 tanh [8192, 9216]", lambda: act_train(8192, 9216, BF16, "gelu_tanh")),
        ("gelu_and_mul_train fp32 erf [2048, 1536]", lambda: act_train(2048, 1536, F32, "gelu")),
        ("lora_delta bf16 T64 4096->4096 r16 8 adapters", lambda: lora_delta(64, 4096, 4096, 16, 8, BF16)),
        ("lora_delta fp32 T37 576->192 r8 4 adapters", lambda: lora_delta(37, 576, 192, 8, 4, F32)),
    ]


def kernel_modules() -> list:
    """The modules whose Triton kernels this script compiles (the MLA/DSA and MoE ones have their own)."""
    from tokenfab.kernels import (
        activation,
        activation_train,
        attention_decode,
        attention_prefill,
        kv_cache,
        lora,
        loss,
        moe_train,
        norm,
        norm_train,
        paged,
        rope,
        rope_train,
        sampling,
    )

    return [activation, activation_train, attention_decode, attention_prefill, kv_cache, lora, loss, moe_train, norm,
            norm_train, paged, rope, rope_train, sampling]


# The fast tier's subset (--quick): every kernel and every constexpr branch the tests check, at the
# dispatcher's configs (the largest tiles, 16-bit and fp32, the chunked and largest rows); the slow
# tier compiles every workload.
QUICK = ("rms_norm bf16 [257, 4096]", "rms_norm bf16 [37, 16384]", "add_rms_norm bf16 [257, 4096]",
         "rotary neox bf16", "rotary gptj bf16", "silu_and_mul bf16", "gelu_and_mul bf16 tanh",
         "store_kv bf16 8 heads", "decode bf16 B64 32/8 d128 (split)", "decode bf16 B64 8/4 d256 softcap",
         "decode bf16 B64 64/8 d64 window+sinks", "decode fp32 B8 32/8 d128", "prefill bf16 32/8 d128",
         "prefill bf16 8/4 d256 softcap+window", "prefill fp32 32/8 d128", "sample fp32",
         "flce rows bf16 [2048, 128256] smoothing+z", "grouped gemm train bf16 qwen3-30b-a3b gate_up",
         "grouped gemm train fp32", "rms_norm_train bf16 [2048, 16384]", "rope_train bf16",
         "silu_and_mul_train bf16", "gelu_and_mul_train fp32 erf", "lora_delta bf16")


def compile_all(only: str | None = None, quick: bool = False) -> list[dict]:
    """Compile every kernel launch of every workload (``quick``: of QUICK's); one record per launch."""
    return compile_workloads(kernel_modules(), _workloads(), only, on_request=ON_REQUEST,
                             subset=QUICK if quick else None)


def main(argv: list[str] | None = None) -> int:
    return run_cli(compile_all, __doc__.splitlines()[0], argv, quick=True)


if __name__ == "__main__":
    raise SystemExit(main())
