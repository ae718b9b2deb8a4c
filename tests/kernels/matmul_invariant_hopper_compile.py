"""Compile the batch-invariant matmul (kernels/matmul_invariant.py) for Hopper (sm_90) without a GPU,
at the configs ``invariant_config`` picks (kernel rule 5), and read registers, shared/local memory
and the SASS (HGMMA: warp-group tensor-core MMA).

Workloads: Llama-3.1-8B's projections in bf16 (qkv 6144x4096, gate_up 28672x4096, down
4096x14336, the LM head 128256x4096) at M = 1 (decode), 5 (a verify of k = 4) and 4096 rows
(the config is the same for every M; the grid is not), and float32 (576x960, the bundled model's
MLP width).

    TRITON_INTERPRET=0 python tests/kernels/matmul_invariant_hopper_compile.py --json out.json --markdown
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


def _mm(m: int, n: int, k: int, dtype: torch.dtype, bias: bool = False) -> None:
    from tokenfab.kernels import matmul_invariant

    b = torch.empty(n, dtype=dtype) if bias else None
    matmul_invariant._matmul_invariant_triton(torch.empty(m, k, dtype=dtype), torch.empty(n, k, dtype=dtype), b)


def _workloads() -> list[tuple[str, Callable[[], None]]]:
    work: list[tuple[str, Callable[[], None]]] = []
    # M = 1, M = 5 and M % 16 == 0 are Triton's three specialisations of the row count
    for name, n, k, ms in (("qkv", 6144, 4096, (1, 5, 4096)), ("gate_up", 28672, 4096, (1, 4096)),
                           ("down", 4096, 14336, (5,)), ("lm_head", 128256, 4096, (5,))):
        for m in ms:
            work.append((f"invariant mm bf16 llama-8b {name} {n}x{k} M={m}", lambda m=m, n=n, k=k: _mm(m, n, k, BF16)))
    work.append(("invariant mm bf16 qwen2 qkv+bias 1280x896 M=5", lambda: _mm(5, 1280, 896, BF16, True)))
    work.append(("invariant mm fp32 576x960 M=5", lambda: _mm(5, 960, 576, F32)))
    work.append(("invariant mm fp32 4096x4090 ragged K M=64", lambda: _mm(64, 4096, 4090, F32)))
    return work


def compile_all(only: str | None = None) -> list[dict]:
    from tokenfab.kernels import matmul_invariant

    return compile_workloads([matmul_invariant], _workloads(), only)


def main(argv: list[str] | None = None) -> int:
    return run_cli(compile_all, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    raise SystemExit(main())
