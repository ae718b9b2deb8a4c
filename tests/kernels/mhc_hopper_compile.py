"""Compile the mHC kernels (DeepSeek-V4's hyper-connection weights + Sinkhorn + collapse, and the expand) for
Hopper (sm_90) without a GPU, at the dispatcher's configs (``hopper_harness.py``).

Workloads: 4 streams of 4096 (V4-Flash) and 7168 (V4-Pro) in bf16, a float32 twin; 2048-token prefill and
64-token decode batches.

    TRITON_INTERPRET=0 python tests/kernels/mhc_hopper_compile.py --json out.json --markdown
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

N = 4


def _pre(dtype: torch.dtype, t: int, d: int) -> None:
    from tokenfab.kernels import mhc

    mhc._mhc_pre_triton(torch.empty(t, N, d, dtype=dtype), torch.empty((2 + N) * N, N * d), torch.empty((2 + N) * N),
                        torch.empty(3), 20, 1e-6, 1e-6)


def _post(dtype: torch.dtype, t: int, d: int) -> None:
    from tokenfab.kernels import mhc

    mhc._mhc_post_triton(torch.empty(t, N, d, dtype=dtype), torch.empty(t, d, dtype=dtype), torch.empty(t, N),
                         torch.empty(t, N, N))


def _workloads() -> list[tuple[str, Callable[[], None]]]:
    return [
        ("mhc pre bf16 T2048 D4096", lambda: _pre(BF16, 2048, 4096)),
        ("mhc pre bf16 T64 D7168", lambda: _pre(BF16, 64, 7168)),
        ("mhc pre fp32 T64 D4096", lambda: _pre(F32, 64, 4096)),
        ("mhc post bf16 T2048 D4096", lambda: _post(BF16, 2048, 4096)),
        ("mhc post fp32 T64 D7168", lambda: _post(F32, 64, 7168)),
    ]


def kernel_modules() -> list:
    from tokenfab.kernels import mhc

    return [mhc]


def compile_all(only: str | None = None, quick: bool = False) -> list[dict]:
    return compile_workloads(kernel_modules(), _workloads(), only)


def main(argv: list[str] | None = None) -> int:
    return run_cli(compile_all, __doc__.splitlines()[0], argv, quick=True)


if __name__ == "__main__":
    raise SystemExit(main())
