"""Compile the MLA and DSA Triton kernels for Hopper (sm_90) without a GPU, at the dispatcher's configs.

Reuses the kernel suite's compile-only launcher (``tests/kernels/hopper_compile.py``: each
``kernel[grid](...)`` launch is compiled for ``GPUTarget("cuda", 90, 32)`` with the specialisation a
real launch would get, and ``cuobjdump`` reads registers, shared/local memory and the SASS).
Workloads: DeepSeek-V3 sizes (128 heads, latent 512 + rope 64, bf16) for decode at batch 1 and 64
(split-KV + reduce), a mixed prefill batch through the absorbed form, a tensor-parallel slice
(16 heads), and fp32; DeepSeek Sparse Attention's indexer scores (64 heads of 128, V3.2) and sparse
MLA over 2048 selected keys.

    TRITON_INTERPRET=0 python tests/kernels/mla_hopper_compile.py --json out.json --markdown
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

# the FP8 latent cache: rows labelled fp8-kv compile with --only fp8-kv
from tests.kernels.hopper_harness import BF16, F32, FP8, ON_REQUEST, compile_workloads, run_cli  # noqa: E402


def _mla(q_lens: list[int], ctx: int, h: int, r: int, rope: int, dtype: torch.dtype, bs: int = 64,
         fp8: bool = False) -> None:
    """Launch MLA attention on CPU tensors (contents unused: nothing runs, only shapes matter)."""
    from tokenfab.kernels import mla

    b = len(q_lens)
    nblk = (ctx + bs - 1) // bs
    cache = torch.empty(b * nblk + 1, bs, 1, r + rope, dtype=FP8 if fp8 else dtype)
    bt = torch.arange(b * nblk, dtype=torch.int32).view(b, nblk)
    q = torch.empty(sum(q_lens), h, r + rope, dtype=dtype)
    cu = torch.zeros(b + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens, dtype=torch.int32).cumsum(0)
    lens = torch.full((b,), ctx, dtype=torch.int32)
    mla._mla_attention_triton(q, cache, bt, cu, lens, max(q_lens), ctx, 0.1, r, torch.ones(1) if fp8 else None)


def _dsa_index(t: int, ctx: int, hi: int, di: int, dtype: torch.dtype, bs: int = 64, fp8: bool = False) -> None:
    from tokenfab.kernels import dsa

    nblk = (ctx + bs - 1) // bs
    cache = torch.empty(nblk + 1, bs, 1, 576 + di, dtype=FP8 if fp8 else dtype)
    bt = torch.arange(nblk, dtype=torch.int32).view(1, nblk)
    cu = torch.tensor([0, t], dtype=torch.int32)
    dsa._dsa_index_scores_triton(torch.empty(t, hi, di, dtype=dtype), torch.empty(t, hi), cache, bt, cu,
                                 torch.tensor([ctx], dtype=torch.int32), t, ctx, 576)


def _dsa_topk(t: int, n: int, k: int) -> None:
    from tokenfab.kernels import dsa

    dsa._dsa_topk_triton(torch.empty(t, n), k)


def _dsa_sparse(b: int, h: int, topk: int, dtype: torch.dtype, r: int = 512, rope: int = 64, bs: int = 64,
                fp8: bool = False) -> None:
    from tokenfab.kernels import dsa

    ctx = 4096
    nblk = ctx // bs
    cache = torch.empty(b * nblk + 1, bs, 1, r + rope + 128, dtype=FP8 if fp8 else dtype)
    bt = torch.arange(b * nblk, dtype=torch.int32).view(b, nblk)
    cu = torch.arange(b + 1, dtype=torch.int32)
    idx = torch.zeros(b, topk, dtype=torch.int32)
    dsa._dsa_sparse_attention_triton(torch.empty(b, h, r + rope, dtype=dtype), cache, bt, cu,
                                     torch.full((b,), ctx, dtype=torch.int32), idx, 0.1, r,
                                     torch.ones(1) if fp8 else None)


def _workloads() -> list[tuple[str, Callable[[], None]]]:
    return [
        ("dsa index bf16 T=8 Hi64 d128 (V3.2)", lambda: _dsa_index(8, 4096, 64, 128, BF16)),
        ("dsa index bf16 T=8 Hi32 d128 (GLM-5)", lambda: _dsa_index(8, 4096, 32, 128, BF16)),
        ("dsa index fp32 T=8 Hi16 d32", lambda: _dsa_index(8, 300, 16, 32, F32)),
        ("dsa topk fp32 T=64 L=4096 k=2048", lambda: _dsa_topk(64, 4096, 2048)),
        ("dsa sparse bf16 B64 H128 top-2048", lambda: _dsa_sparse(64, 128, 2048, BF16)),
        ("dsa sparse bf16 B8 H16 top-2048", lambda: _dsa_sparse(8, 16, 2048, BF16)),
        ("dsa sparse fp32 B8 H4 top-64", lambda: _dsa_sparse(8, 4, 64, F32, 32, 16)),
        ("mla decode bf16 B64 H128 r512+64 (DeepSeek-V3)", lambda: _mla([1] * 64, 256, 128, 512, 64, BF16)),
        ("mla decode bf16 B1 H128 r512+64 (splits)", lambda: _mla([1], 256, 128, 512, 64, BF16)),
        ("mla decode bf16 B8 H16 r512+64 (TP8 slice)", lambda: _mla([1] * 8, 256, 16, 512, 64, BF16)),
        ("mla mixed bf16 T=300 H128 r512+64", lambda: _mla([1, 1, 298], 512, 128, 512, 64, BF16)),
        ("mla decode fp32 B8 H4 r32+16", lambda: _mla([1] * 8, 256, 4, 32, 16, F32)),
        ("mla decode bf16 fp8-kv B64 H128 r512+64", lambda: _mla([1] * 64, 256, 128, 512, 64, BF16, fp8=True)),
        ("mla decode bf16 fp8-kv B1 H128 r512+64 (splits)", lambda: _mla([1], 256, 128, 512, 64, BF16, fp8=True)),
        ("mla decode bf16 fp8-kv B8 H16 r512+64 (TP8 slice)",
         lambda: _mla([1] * 8, 256, 16, 512, 64, BF16, fp8=True)),
        ("mla mixed bf16 fp8-kv T=300 H128 r512+64", lambda: _mla([1, 1, 298], 512, 128, 512, 64, BF16, fp8=True)),
        ("dsa sparse bf16 fp8-kv B64 H128 top-2048", lambda: _dsa_sparse(64, 128, 2048, BF16, fp8=True)),
        ("dsa index bf16 fp8-kv T=8 Hi64 d128 (V3.2)", lambda: _dsa_index(8, 4096, 64, 128, BF16, fp8=True)),
    ]


# The fast tier's subset (--quick): every kernel at DeepSeek-V3 / V3.2's sizes (decode with and without
# splits, the mixed batch) and fp32 MLA; the slow tier compiles every workload.
QUICK = ("dsa index bf16 T=8 Hi64", "dsa topk", "dsa sparse bf16 B64", "mla decode bf16 B64 H128",
         "mla decode bf16 B1 H128", "mla mixed bf16 T=300", "mla decode fp32")


def compile_all(only: str | None = None, quick: bool = False) -> list[dict]:
    from tokenfab.kernels import dsa, dsa_indexer, mla, paged

    return compile_workloads([mla, dsa, dsa_indexer, paged], _workloads(), only, on_request=ON_REQUEST,
                             subset=QUICK if quick else None)


def main(argv: list[str] | None = None) -> int:
    return run_cli(compile_all, __doc__.splitlines()[0], argv, quick=True)


if __name__ == "__main__":
    raise SystemExit(main())
