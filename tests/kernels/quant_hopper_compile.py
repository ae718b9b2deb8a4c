"""Compile the FP8 Triton kernels (kernels/quant.py) for Hopper (sm_90) without a GPU, at the
dispatcher's configs (``quant_config`` / ``mm_config``), and read their SASS: FP8 tensor-core
instructions (``QGMMA``: warp-group MMA with e4m3 operands), registers, shared and local memory.

Workloads: activation quant of Llama-8B's hidden (4096) at 1 and 4096 tokens; the block-scaled
W8A8 GEMM at 1 / 16 / 256 / 4096 tokens for Llama-3.1-8B's gate_up (28672 x 4096) and a DeepSeek-V3
expert's down projection (7168 x 2048), the per-channel variant (compressed-tensors / online FP8),
and the FP8 fused MoE at DeepSeek-V3's layer shape (256 experts, top-8, hidden 7168, expert 2048).

    TRITON_INTERPRET=0 python tests/kernels/quant_hopper_compile.py --json out.json --markdown
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.kernels.hopper_harness import FP8, compile_workloads, run_cli  # noqa: E402


def _gemm(m: int, n: int, k: int, block: bool) -> None:
    from tokenfab.kernels import quant

    a = torch.empty(m, k, dtype=FP8)
    w = torch.empty(n, k, dtype=FP8)
    a_s = torch.empty(m, (k + 127) // 128 if block else 1)
    w_s = torch.empty((n + 127) // 128, (k + 127) // 128) if block else torch.empty(n, 1)
    quant._w8a8_scaled_mm_triton(a, a_s, w, w_s, 128 if block else 1, torch.bfloat16)


def _act(m: int, k: int, ue8m0: bool) -> None:
    from tokenfab.kernels import quant

    quant._per_token_group_quant_triton(torch.empty(m, k, dtype=torch.bfloat16), 128, ue8m0)


def _workloads() -> list[tuple[str, Callable[[], None]]]:
    work: list[tuple[str, Callable[[], None]]] = [
        ("act quant bf16 [1, 4096]", lambda: _act(1, 4096, False)),
        ("act quant bf16 [4096, 4096] ue8m0", lambda: _act(4096, 4096, True)),
    ]
    for m in (1, 16, 256, 4096):
        work.append((f"fp8 block gemm llama-8b gate_up 28672x4096 M={m}", lambda m=m: _gemm(m, 28672, 4096, True)))
    for m in (1, 4096):
        work.append((f"fp8 block gemm deepseek expert down 7168x2048 M={m}",
                     lambda m=m: _gemm(m, 7168, 2048, True)))
    work.append(("fp8 channel gemm llama-8b down 4096x14336 M=4096", lambda: _gemm(4096, 4096, 14336, False)))
    for t in (1, 1024, 4096):  # 256 experts, top-8: 1 / 32 / 128 rows per expert
        work.append((f"fp8 fused moe deepseek-v3 (E=256 top-8 H=7168 I=2048) T={t}", lambda t=t: _moe(t)))
    return work


def _moe(t: int) -> None:
    from tokenfab.kernels import moe_fp8

    e, k, h, i = 256, 8, 7168, 2048
    x = torch.empty(t, h, dtype=torch.bfloat16)
    w13, w2 = torch.empty(e, 2 * i, h, dtype=FP8), torch.empty(e, h, i, dtype=FP8)
    s13, s2 = torch.empty(e, 2 * i // 128, h // 128), torch.empty(e, h // 128, i // 128)
    ids = (torch.arange(t * k, dtype=torch.int32) % e).view(t, k)
    moe_fp8._fused_experts_fp8_triton(x, w13, s13, w2, s2, 128, 128, torch.full((t, k), 1.0 / k), ids)


# The fast tier's subset (--quick): both activation quants, the block and per-channel GEMMs at decode
# and at the largest tile, the fused MoE at decode and at its largest tile.
QUICK = ("act quant", "fp8 block gemm llama-8b gate_up 28672x4096 M=1", "fp8 block gemm llama-8b gate_up "
         "28672x4096 M=4096", "fp8 channel gemm", "fp8 fused moe deepseek-v3 (E=256 top-8 H=7168 I=2048) T=1",
         "fp8 fused moe deepseek-v3 (E=256 top-8 H=7168 I=2048) T=4096")


def compile_all(only: str | None = None, quick: bool = False) -> list[dict]:
    from tokenfab.kernels import moe_align, moe_fp8, moe_gemm, quant

    return compile_workloads([quant, moe_fp8, moe_align, moe_gemm], _workloads(), only,
                             subset=QUICK if quick else None)


def main(argv: list[str] | None = None) -> int:
    return run_cli(compile_all, __doc__.splitlines()[0], argv, quick=True)


if __name__ == "__main__":
    raise SystemExit(main())
