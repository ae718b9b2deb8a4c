"""Compile multi-LoRA-on-MoE-experts' Triton path (``kernels/moe_lora.py``) for Hopper (sm_90) without a GPU, at
the dispatcher's configs: the gate/up grouped GEMM with the deltas added, with the BGMV deltas, the align, down and
sum kernels it launches, at a Qwen3-30B-A3B-like shape (128 experts, top-8, hidden 2048, expert intermediate 768)
with 4 adapters of rank 16, decode to prefill.

    TRITON_INTERPRET=0 python tests/kernels/moe_lora_hopper_compile.py --json out.json --markdown
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


def _experts_lora(t: int, e: int, k: int, h: int, i: int, r: int, s: int, dtype: torch.dtype) -> None:
    """Launch the LoRA experts' path on CPU tensors (contents unused: only shapes matter)."""
    from tokenfab.kernels import moe_lora

    x = torch.empty(t, h, dtype=dtype)
    w13, w2 = torch.empty(e, 2 * i, h, dtype=dtype), torch.empty(e, h, i, dtype=dtype)
    ids = (torch.arange(t * k, dtype=torch.int32) % e).view(t, k)
    w = torch.full((t, k), 1.0 / k)
    slots = torch.arange(t, dtype=torch.int32) % (s + 1) - 1
    pools = [torch.empty(e, s, r, h, dtype=dtype), torch.empty(e, s, i, r, dtype=dtype),
             torch.empty(e, s, r, h, dtype=dtype), torch.empty(e, s, i, r, dtype=dtype),
             torch.empty(e, s, r, i, dtype=dtype), torch.empty(e, s, h, r, dtype=dtype)]
    moe_lora._fused_experts_lora_triton(x, w13, w2, w, ids, slots, *pools)


def _workloads() -> list[tuple[str, Callable[[], None]]]:
    return [
        ("qwen3-30b-a3b lora r16 x4 bf16 T=1", lambda: _experts_lora(1, 128, 8, 2048, 768, 16, 4, BF16)),
        ("qwen3-30b-a3b lora r16 x4 bf16 T=64", lambda: _experts_lora(64, 128, 8, 2048, 768, 16, 4, BF16)),
        ("qwen3-30b-a3b lora r16 x4 bf16 T=2048", lambda: _experts_lora(2048, 128, 8, 2048, 768, 16, 4, BF16)),
        ("mixtral-8x7b lora r8 x2 bf16 T=512", lambda: _experts_lora(512, 8, 2, 4096, 14336, 8, 2, BF16)),
        ("qwen3-30b-a3b lora r16 x4 fp32 T=64", lambda: _experts_lora(64, 128, 8, 2048, 768, 16, 4, F32)),
    ]


QUICK = ("qwen3-30b-a3b lora r16 x4 bf16 T=1", "qwen3-30b-a3b lora r16 x4 bf16 T=2048")


def compile_all(only: str | None = None, quick: bool = False) -> list[dict]:
    from tokenfab.kernels import lora, moe_align, moe_gemm, moe_lora

    return compile_workloads([moe_lora, lora, moe_align, moe_gemm], _workloads(), only,
                             subset=QUICK if quick else None)


def main(argv: list[str] | None = None) -> int:
    return run_cli(compile_all, __doc__.splitlines()[0], argv, quick=True)


if __name__ == "__main__":
    raise SystemExit(main())
