"""Compile the MoE Triton kernels for Hopper (sm_90) without a GPU, at the dispatcher's configs.

Reuses the kernel suite's compile-only launcher (``tests/kernels/hopper_compile.py``: each
``kernel[grid](...)`` launch is compiled for ``GPUTarget("cuda", 90, 32)`` with the specialisation a
real launch would get, and ``cuobjdump`` reads registers, shared/local memory and the SASS).
Workloads: routing, align, both grouped GEMMs at every tile bucket of ``moe_config`` (decode to
8192-token prefill) at a Qwen3-30B-A3B-like shape (128 experts, top-8, hidden 2048, expert
intermediate 768), GPT-OSS's (biases, clamped SwiGLU, hidden 2880), fp32, and the sum.

    TRITON_INTERPRET=0 python tests/kernels/moe_hopper_compile.py --json out.json --markdown
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.kernels.hopper_harness import BF16, F32, compile_workloads, run_cli  # noqa: E402


def _experts(t: int, e: int, k: int, h: int, i: int, dtype: torch.dtype, act: str = "silu", bias: bool = False):
    """Launch the fused-experts path on CPU tensors (contents unused: nothing runs, only shapes matter)."""
    from tokenfab.kernels import moe

    x = torch.empty(t, h, dtype=dtype)
    w13 = torch.empty(e, 2 * i, h, dtype=dtype)
    w2 = torch.empty(e, h, i, dtype=dtype)
    ids = (torch.arange(t * k, dtype=torch.int32) % e).view(t, k)
    w = torch.full((t, k), 1.0 / k)
    b13 = torch.empty(e, 2 * i, dtype=dtype) if bias else None
    b2 = torch.empty(e, h, dtype=dtype) if bias else None
    moe._fused_experts_triton(x, w13, w2, w, ids, b13, b2, act)


def _workloads() -> list[tuple[str, Callable[[], None]]]:
    from tokenfab.kernels import moe

    def topk(t, e, k):
        moe._topk_softmax_triton(torch.empty(t, e, dtype=BF16), k, True)

    def grouped(t, e, k, g, tg):
        moe._grouped_topk_triton(torch.empty(t, e, dtype=F32), torch.empty(e), k, g, tg, True, 2.5, "sigmoid")

    return [
        ("topk_softmax bf16 [8192, 128] top-8", lambda: topk(8192, 128, 8)),
        ("topk_softmax bf16 [64, 32] top-4", lambda: topk(64, 32, 4)),
        ("grouped_topk fp32 [8192, 256] 8 groups top-4 / top-8", lambda: grouped(8192, 256, 8, 8, 4)),
        ("qwen3-30b-a3b bf16 T=1", lambda: _experts(1, 128, 8, 2048, 768, BF16)),
        ("qwen3-30b-a3b bf16 T=64", lambda: _experts(64, 128, 8, 2048, 768, BF16)),
        ("qwen3-30b-a3b bf16 T=512", lambda: _experts(512, 128, 8, 2048, 768, BF16)),
        ("qwen3-30b-a3b bf16 T=1024", lambda: _experts(1024, 128, 8, 2048, 768, BF16)),
        ("qwen3-30b-a3b bf16 T=8192", lambda: _experts(8192, 128, 8, 2048, 768, BF16)),
        ("gpt-oss-20b bf16 T=8192 (bias, clamped swiglu)",
         lambda: _experts(8192, 32, 4, 2880, 2880, BF16, "swiglu_oai", True)),
        ("mixtral-8x7b bf16 T=4096", lambda: _experts(4096, 8, 2, 4096, 14336, BF16)),
        ("qwen3-30b-a3b fp32 T=1024", lambda: _experts(1024, 128, 8, 2048, 768, F32)),
    ]


# The fast tier's subset (--quick: routing, decode, the 8192-token tiles); the slow tier compiles every workload.
QUICK = ("topk_softmax bf16 [8192, 128] top-8", "grouped_topk", "qwen3-30b-a3b bf16 T=1", "qwen3-30b-a3b bf16 T=8192",
         "gpt-oss-20b")


def compile_all(only: str | None = None, quick: bool = False) -> list[dict]:
    from tokenfab.kernels import moe_align, moe_gemm, moe_routing

    return compile_workloads([moe_routing, moe_align, moe_gemm], _workloads(), only,
                             subset=QUICK if quick else None)


def main(argv: list[str] | None = None) -> int:
    return run_cli(compile_all, __doc__.splitlines()[0], argv, quick=True)


if __name__ == "__main__":
    raise SystemExit(main())
