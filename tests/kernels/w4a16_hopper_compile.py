"""Compile the W4A16 Triton kernels (dense GEMM and fused MoE) for Hopper (sm_90) without a GPU.

Reuses the kernel suite's compile-only launcher (``tests/kernels/hopper_compile.py``). Workloads:
the dense GEMM for every codec at Llama-3.1-8B shapes (decode 1/16 rows, 256 and 4096 rows),
and the fused-MoE variant at Kimi-K2-like (INT4, 384 experts, top-8, hidden 7168, expert 2048)
and GPT-OSS-20b (MXFP4, 32 experts, top-4, hidden 2880, biases, clamped SwiGLU) shapes.

    TRITON_INTERPRET=0 python tests/kernels/w4a16_hopper_compile.py --json out.json --markdown
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


def _scales(codec: str, n: int, k: int) -> torch.Tensor:
    from tokenfab.kernels.w4a16 import GROUP_SIZE

    g = (k + GROUP_SIZE[codec] - 1) // GROUP_SIZE[codec]
    if codec == "int4":
        return torch.empty(n, g, dtype=BF16)
    return torch.empty(n, g, dtype=torch.uint8)


def _dense(m: int, n: int, k: int, codec: str, dtype: torch.dtype = BF16) -> None:
    from tokenfab.kernels import w4a16

    gs = torch.ones(()) if codec == "nvfp4" else None
    w4a16._w4a16_gemm_triton(torch.empty(m, k, dtype=dtype), torch.empty(n, k // 2, dtype=torch.uint8),
                             _scales(codec, n, k), gs, None, codec, k)


def _moe(t: int, e: int, k: int, h: int, i: int, codec: str, act: str = "silu", bias: bool = False) -> None:
    from tokenfab.kernels import moe_w4a16

    ids = (torch.arange(t * k, dtype=torch.int32) % e).view(t, k)
    w13 = (torch.empty(e, 2 * i, h // 2, dtype=torch.uint8), _scales(codec, e * 2 * i, h).view(e, 2 * i, -1))
    w2 = (torch.empty(e, h, i // 2, dtype=torch.uint8), _scales(codec, e * h, i).view(e, h, -1))
    moe_w4a16._fused_experts_w4a16_triton(
        torch.empty(t, h, dtype=BF16), w13[0], w13[1], w2[0], w2[1], torch.full((t, k), 1.0 / k), ids,
        torch.empty(e, 2 * i, dtype=BF16) if bias else None, torch.empty(e, h, dtype=BF16) if bias else None,
        None, None, codec, act)


def _workloads() -> list[tuple[str, Callable[[], None]]]:
    out: list[tuple[str, Callable[[], None]]] = []
    for codec in ("int4", "mxfp4", "nvfp4"):
        for m in (1, 16, 256, 4096):
            out.append((f"w4a16 {codec} bf16 llama-8b down M={m}", lambda m=m, c=codec: _dense(m, 4096, 14336, c)))
    out.append(("w4a16 int4 fp32 M=37", lambda: _dense(37, 4096, 4096, "int4", F32)))
    out += [
        ("moe_w4a16 int4 kimi-k2 T=1", lambda: _moe(1, 384, 8, 7168, 2048, "int4")),
        ("moe_w4a16 int4 kimi-k2 T=16", lambda: _moe(16, 384, 8, 7168, 2048, "int4")),
        ("moe_w4a16 int4 kimi-k2 T=4096", lambda: _moe(4096, 384, 8, 7168, 2048, "int4")),
        ("moe_w4a16 mxfp4 gpt-oss-20b T=1 (bias, clamped swiglu)",
         lambda: _moe(1, 32, 4, 2880, 2880, "mxfp4", "swiglu_oai", True)),
        ("moe_w4a16 mxfp4 gpt-oss-20b T=4096 (bias, clamped swiglu)",
         lambda: _moe(4096, 32, 4, 2880, 2880, "mxfp4", "swiglu_oai", True)),
    ]
    return out


def kernel_modules() -> list:
    from tokenfab.kernels import moe_align, moe_gemm, moe_w4a16, w4a16

    return [w4a16, moe_w4a16, moe_align, moe_gemm]


# The fast tier's subset (--quick): every codec at decode (split K) and at the largest prefill tile,
# the fused MoE at decode (INT4) and at its largest tile (MXFP4, biases, clamped SwiGLU).
QUICK = tuple(f"w4a16 {c} bf16 llama-8b down M={m}" for c in ("int4", "mxfp4", "nvfp4") for m in (1, 4096)) + (
    "moe_w4a16 int4 kimi-k2 T=1", "moe_w4a16 mxfp4 gpt-oss-20b T=4096")


def compile_all(only: str | None = None, quick: bool = False) -> list[dict]:
    return compile_workloads(kernel_modules(), _workloads(), only, subset=QUICK if quick else None)


def main(argv: list[str] | None = None) -> int:
    return run_cli(compile_all, __doc__.splitlines()[0], argv, quick=True)


if __name__ == "__main__":
    raise SystemExit(main())
