"""Compile the Gated DeltaNet kernels (gated delta rule prefill (16-bit and float32 passes) and decode, causal conv1d
prefill, state roll and update) for Hopper (sm_90) without a GPU, at the dispatcher's configs (``hopper_harness.py``).

Workloads: Qwen3-Next-80B-A3B's linear-attention layer (16 key heads, 32 value heads, head dims 128, conv channels
2 * 16 * 128 + 32 * 128 = 8192, width 4) in bf16 with float32 states, and a float32 twin; a varlen prefill
batch of three sequences and a decode batch of 64.

    TRITON_INTERPRET=0 python tests/kernels/gated_delta_hopper_compile.py --json out.json --markdown
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

HK, HV, DK, DV, CONV_DIM, WIDTH = 16, 32, 128, 128, 8192, 4


def _batch(lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    cu = torch.zeros(len(lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(lens, dtype=torch.int32).cumsum(0)
    return cu, torch.arange(len(lens), dtype=torch.int32)


def _gdn_prefill(dtype: torch.dtype, lens: list[int], has_state: bool) -> None:
    from tokenfab.kernels import gated_delta

    t = sum(lens)
    cu, slots = _batch(lens)
    qkv = torch.empty(t, CONV_DIM, dtype=dtype)  # the conv output the model splits (strided views)
    q = qkv[:, : HK * DK].view(t, HK, DK)
    k = qkv[:, HK * DK: 2 * HK * DK].view(t, HK, DK)
    v = qkv[:, 2 * HK * DK:].view(t, HV, DV)
    state = torch.empty(8, HV, DK, DV, dtype=F32)
    flags = torch.ones(len(lens), dtype=torch.bool) if has_state else None
    gated_delta._gated_delta_prefill_triton(q, k, v, torch.empty(t, HV), torch.empty(t, HV, dtype=dtype), cu, state,
                                            slots, flags, DK**-0.5, True)


def _gdn_decode(dtype: torch.dtype, b: int) -> None:
    from tokenfab.kernels import gated_delta

    state = torch.empty(b + 1, HV, DK, DV, dtype=F32)
    gated_delta._gated_delta_decode_triton(torch.empty(b, HK, DK, dtype=dtype), torch.empty(b, HK, DK, dtype=dtype),
                                           torch.empty(b, HV, DV, dtype=dtype), torch.empty(b, HV),
                                           torch.empty(b, HV, dtype=dtype), state,
                                           torch.arange(b, dtype=torch.int32), DK**-0.5, True)


def _conv_prefill(dtype: torch.dtype, lens: list[int], has_state: bool, bias: bool) -> None:
    from tokenfab.kernels import causal_conv1d

    cu, slots = _batch(lens)
    flags = torch.ones(len(lens), dtype=torch.bool) if has_state else None
    causal_conv1d._causal_conv1d_prefill_triton(
        torch.empty(sum(lens), CONV_DIM, dtype=dtype), torch.empty(CONV_DIM, WIDTH, dtype=dtype),
        torch.empty(CONV_DIM, dtype=dtype) if bias else None, cu, torch.empty(8, CONV_DIM, WIDTH - 1, dtype=dtype),
        slots, flags, True)


def _conv_update(dtype: torch.dtype, b: int, bias: bool) -> None:
    from tokenfab.kernels import causal_conv1d

    causal_conv1d._causal_conv1d_update_triton(
        torch.empty(b, CONV_DIM, dtype=dtype), torch.empty(CONV_DIM, WIDTH, dtype=dtype),
        torch.empty(CONV_DIM, dtype=dtype) if bias else None, torch.empty(b + 1, CONV_DIM, WIDTH - 1, dtype=dtype),
        torch.arange(b, dtype=torch.int32), True)


def _workloads() -> list[tuple[str, Callable[[], None]]]:
    lens = [1000, 65, 7]
    return [
        ("gdn prefill bf16 16/32 heads d128 varlen", lambda: _gdn_prefill(BF16, lens, True)),
        ("gdn prefill bf16 16/32 heads d128 fresh", lambda: _gdn_prefill(BF16, lens, False)),
        ("gdn prefill fp32 16/32 heads d128 varlen", lambda: _gdn_prefill(F32, lens, True)),
        ("gdn decode bf16 B64 16/32 heads d128", lambda: _gdn_decode(BF16, 64)),
        ("gdn decode fp32 B8 16/32 heads d128", lambda: _gdn_decode(F32, 8)),
        ("conv1d prefill bf16 D8192 W4 varlen", lambda: _conv_prefill(BF16, lens, True, False)),
        ("conv1d prefill bf16 D8192 W4 fresh+bias", lambda: _conv_prefill(BF16, lens, False, True)),
        ("conv1d prefill fp32 D8192 W4 varlen", lambda: _conv_prefill(F32, lens, True, False)),
        ("conv1d update bf16 B64 D8192 W4", lambda: _conv_update(BF16, 64, False)),
        ("conv1d update fp32 B8 D8192 W4 bias", lambda: _conv_update(F32, 8, True)),
    ]


def kernel_modules() -> list:
    from tokenfab.kernels import causal_conv1d, gated_delta, gated_delta_fp32

    return [causal_conv1d, gated_delta, gated_delta_fp32]


# The fast tier's subset (--quick): every kernel, 16-bit and fp32 where the dot precision differs.
QUICK = ("gdn prefill bf16 16/32 heads d128 varlen", "gdn prefill fp32 16/32 heads d128 varlen",
         "gdn decode bf16 B64 16/32 heads d128", "conv1d prefill bf16 D8192 W4 varlen",
         "conv1d update bf16 B64 D8192 W4")


def compile_all(only: str | None = None, quick: bool = False) -> list[dict]:
    return compile_workloads(kernel_modules(), _workloads(), only, subset=QUICK if quick else None)


def main(argv: list[str] | None = None) -> int:
    return run_cli(compile_all, __doc__.splitlines()[0], argv, quick=True)


if __name__ == "__main__":
    raise SystemExit(main())
