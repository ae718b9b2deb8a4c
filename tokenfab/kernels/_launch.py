"""Small helpers shared by the Triton launchers: device checks, sizes, device properties.

Triton's interpreter (CPU tensors) is chosen when triton is *imported*: ``TRITON_INTERPRET=1``
must be in the environment before the first ``import triton`` of the process. This module sets
it on machines without CUDA when nothing imported triton before; a kernel launched on CPU
tensors without the interpreter fails with a clear message.
"""

from __future__ import annotations

import functools
import os
import sys

import torch

# Without a GPU, Triton kernels can only run in the interpreter, which triton selects when it
# is first imported: choose it now unless the environment says otherwise (TRITON_INTERPRET=0)
# or triton was already imported. The kernel modules import this module before triton.
if "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import triton  # noqa: E402

# H200: 132 multiprocessors. Used for compile-only checks from CPU tensors, so that the launch
# configuration picked there is the one the GPU would get.
DEFAULT_NUM_SMS = 132


@functools.cache
def interpreting() -> bool:
    """True when ``@triton.jit`` functions were built for the interpreter."""
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.max, InterpretedFunction) or isinstance(
        getattr(tl.standard, "max", None), InterpretedFunction
    )


def check_device(t: torch.Tensor) -> None:
    """Raise a clear error when a Triton kernel cannot run on ``t``'s device."""
    if t.is_cuda:
        return
    if t.device.type == "cpu":
        if not interpreting():
            raise RuntimeError(
                "Triton kernels on CPU tensors need the interpreter: set TRITON_INTERPRET=1 "
                "before triton is first imported (or use TOKENFAB_KERNELS=torch)"
            )
        patch_interpreter_bf16()
        return
    raise RuntimeError(f"no Triton kernels for device {t.device}")


def next_pow2(n: int) -> int:
    return triton.next_power_of_2(max(int(n), 1))


@functools.cache
def _num_sms_cuda(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """Multiprocessor count of ``device``.

    CPU tensors run in the interpreter, one program after another: 1, so grids stay small
    (split-KV decode then uses one split). Compiling for Hopper from CPU tensors (the compile
    test) gets the H200's count, so it sees the configuration the GPU would get.
    """
    if device.type == "cuda":
        return _num_sms_cuda(device.index if device.index is not None else torch.cuda.current_device())
    return 1 if interpreting() else DEFAULT_NUM_SMS


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 operands multiply exactly ("ieee"); tf32 would lose 13 mantissa bits."""
    return "ieee" if dtype == torch.float32 else "tf32"


def patch_interpreter_bf16() -> None:
    """Fix bf16 (and fp8) bugs of Triton's interpreter (triton 3.6-3.9) so it computes what the GPU does.

    1. fp32 -> bf16 casts truncate the mantissa; the GPU rounds to nearest even (as torch).
    2. ``tl.dot`` on bf16 operands multiplies their raw uint16 storage; the GPU multiplies the
       values (exactly, into fp32 accumulators).
    ``check_device`` applies it before the first kernel runs in the interpreter; it changes nothing
    for compiled kernels.
    """
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    if getattr(interpreter, "_tokenfab_bf16_patched", False):
        return
    original_convert = interpreter._convert_float

    # 3. casts to/from fp8 e4m3 (the FP8 KV cache) neither round to nearest even nor carry a rounded-up
    #    mantissa into the exponent: torch converts them exactly as the GPU's cvt.rn does (in range)
    fp8 = {tl.float8e4nv: torch.float8_e4m3fn}
    wide = {tl.float32: (torch.float32, np.int32), tl.bfloat16: (torch.bfloat16, np.int16),
            tl.float16: (torch.float16, np.int16)}

    def convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16:
            src = torch.from_numpy(np.ascontiguousarray(input).view(np.float32))
            return src.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16).reshape(input.shape)
        if input_dtype in wide and output_dtype in fp8:
            tdt, idt = wide[input_dtype]
            src = torch.from_numpy(np.ascontiguousarray(input).view(idt)).view(tdt)
            return src.to(fp8[output_dtype]).view(torch.uint8).numpy().reshape(input.shape)
        if input_dtype in fp8 and output_dtype in wide:
            tdt, idt = wide[output_dtype]
            src = torch.from_numpy(np.ascontiguousarray(input).view(np.uint8)).view(fp8[input_dtype])
            out = src.to(tdt).view(torch.int32 if idt == np.int32 else torch.int16).numpy()
            return out.view(np.uint32 if idt == np.int32 else np.uint16).reshape(input.shape)
        return original_convert(input, input_dtype, output_dtype, rounding_mode)

    builder_cls = type(interpreter.interpreter_builder)
    original_dot = builder_cls.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        def up(h):
            if h.dtype.scalar == tl.bfloat16:
                data = original_convert(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
                return interpreter.TensorHandle(data, tl.float32)
            return h

        return original_dot(self, up(a), up(b), d, input_precision, max_num_imprecise_acc)

    interpreter._convert_float = convert
    builder_cls.create_dot = create_dot
    interpreter._tokenfab_bf16_patched = True
