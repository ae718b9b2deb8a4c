"""Compile DeepSeek-V4's attention core, indexer and KV compressor (``kernels/dsv4_attention.py``,
``kernels/dsv4_compressor.py``) for sm_90 without a GPU.

At the dispatcher's config (``hopper_harness.py``): 64 heads of 512 (V4-Flash), a 128-token window and 512
indexer picks (CSA) or 1024 visible entries (HCA at 128k); the indexer's 64 heads of 128 over 32k entries;
the compressors at 512 (CSA's 8 slots, HCA's 128) and the indexer's at 128, a 64-channel RoPE; bf16 and a
float32 twin, decode and prefill batches.

    TRITON_INTERPRET=0 python tests/kernels/dsv4_hopper_compile.py --json out.json --markdown
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

H, D, W = 64, 512, 128


def _attend(dtype: torch.dtype, t: int, entries: int) -> None:
    from tokenfab.kernels import dsv4_attention

    dsv4_attention._dsv4_sparse_attention_triton(
        torch.empty(t, H, D, dtype=dtype), torch.empty(4096, D + 1024, dtype=dtype),
        torch.empty(t, W, dtype=torch.int64), torch.empty(2048, D + 1024, dtype=dtype),
        torch.empty(t, W, dtype=torch.int64), torch.empty(2048, D + 128, dtype=dtype),
        torch.empty(t, entries, dtype=torch.int64), torch.empty(H), D**-0.5)


def _index(dtype: torch.dtype, t: int, entries: int) -> None:
    from tokenfab.kernels import dsv4_attention

    # the scores only: the top-k that follows is dsa_indexer's kernel, compiled by mla_hopper_compile.py
    dsv4_attention._dsv4_index_scores_triton(
        torch.empty(t, 64, 128, dtype=dtype), torch.empty(t, 64), torch.empty(8192, D + 128, dtype=dtype),
        torch.empty(t, entries, dtype=torch.int64), D)


def _compress(dtype: torch.dtype, w: int, d: int, ratio: int, overlap: bool) -> None:
    from tokenfab.kernels import dsv4_compressor

    s = ratio * (2 if overlap else 1)
    row = D + 2 * 2 * D + 2 * 2 * 128  # a CSA layer's token row: kv, the compressor's C and Z, the indexer's
    dsv4_compressor._dsv4_compress_triton(
        torch.empty(4096, row, dtype=dtype), torch.empty(w, s, dtype=torch.int64), torch.empty(8192, row, dtype=dtype),
        torch.empty(w, s, dtype=torch.int64), torch.empty(w, dtype=torch.int64), D, d, ratio, overlap,
        torch.empty(d), torch.empty(32), 1.0, 1e-6)


def _workloads() -> list[tuple[str, Callable[[], None]]]:
    return [
        ("dsv4 compressor bf16 decode W64 CSA d512", lambda: _compress(BF16, 64, D, 4, True)),
        ("dsv4 compressor bf16 prefill W512 HCA d512", lambda: _compress(BF16, 512, D, 128, False)),
        ("dsv4 compressor bf16 prefill W1024 indexer d128", lambda: _compress(BF16, 1024, 128, 4, True)),
        ("dsv4 compressor fp32 decode W8 CSA d512", lambda: _compress(F32, 8, D, 4, True)),
        ("dsv4 compressor fp32 prefill W64 HCA d512", lambda: _compress(F32, 64, D, 128, False)),
        ("dsv4 attention bf16 decode T64 CSA top-512", lambda: _attend(BF16, 64, 512)),
        ("dsv4 attention bf16 prefill T2048 HCA 1024 entries", lambda: _attend(BF16, 2048, 1024)),
        ("dsv4 attention fp32 decode T8 CSA top-512", lambda: _attend(F32, 8, 512)),
        ("dsv4 indexer bf16 decode T64 32k entries (128k context)", lambda: _index(BF16, 64, 32768)),
        ("dsv4 indexer fp32 decode T8 4k entries", lambda: _index(F32, 8, 4096)),
    ]


def kernel_modules() -> list:
    from tokenfab.kernels import dsv4_attention, dsv4_compressor

    return [dsv4_attention, dsv4_compressor]


def compile_all(only: str | None = None, quick: bool = False) -> list[dict]:
    return compile_workloads(kernel_modules(), _workloads(), only)


def main(argv: list[str] | None = None) -> int:
    return run_cli(compile_all, __doc__.splitlines()[0], argv, quick=True)


if __name__ == "__main__":
    raise SystemExit(main())
