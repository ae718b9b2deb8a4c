"""Which code path each native CPU kernel family runs in this process.

The library is built for the machine (``-march=native``, so from its CPUID flags) or for the target
``TOKENFAB_CPU_CFLAGS`` names; each kernel file picks AVX-512, AVX2 + FMA or portable C from that
target at build time (``common.h``, ``ggml_common.h``). ``cpu_kernel_info()`` reads the paths back
from the library (``tf_cpu_isa`` and the GGML family's ``ggml_kernel_info``), so a report, a bench
result or a test can say what ran.
"""

from __future__ import annotations

import torch

from tokenfab.kernels.cpu import native_library
from tokenfab.kernels.cpu.ggml_matmul import ggml_kernel_info

# tf_cpu_isa() bits (elementwise.c)
_AVX512, _AVX2, _AVX512_BF16, _F16C, _AVX512_DQ = 1, 2, 4, 8, 16


def _base(bits: int) -> str:
    return "avx512" if bits & _AVX512 else ("avx2" if bits & _AVX2 else "scalar")


def cpu_kernel_info() -> dict:
    """{family: path} for paged_attention, elementwise, w4a16, fp8, ggml_f32 (W4A32) and ggml_q8
    (int8 activations), plus ``ggml`` (the GGML family's full report: VNNI, F16C, AMX and why)
    and ``f16c``; every path is "torch reference" when there is no native library."""
    lib = native_library()
    ggml = ggml_kernel_info()
    if lib is None:
        ref = "torch reference"
        return {"native": False, "paged_attention": ref, "elementwise": ref, "w4a16": ref, "fp8": ref,
                "ggml_f32": ref, "ggml_q8": ref, "f16c": False, "ggml": ggml,
                "threads": torch.get_num_threads()}
    bits = int(lib.tf_cpu_isa())
    base = _base(bits)
    return {
        "native": True,
        # AVX512-BF16: bfloat16 keys are dotted straight from the cache (vdpbf16ps)
        "paged_attention": base + ("+bf16" if bits & _AVX512_BF16 else ""),
        "elementwise": base,
        "w4a16": base,
        "fp8": base,
        "ggml_f32": ggml["isa"],
        "ggml_q8": ggml["q8_path"],
        "f16c": bool(bits & _F16C),
        "ggml": ggml,
        "threads": int(lib.tf_get_num_threads()),  # every parallel region's count (threads.c)
    }
