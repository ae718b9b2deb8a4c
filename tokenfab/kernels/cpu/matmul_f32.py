"""A row-invariant float32 matmul for the CPU (``matmul_f32_rowinv`` in ``ggml_matmul.c``).

``y = x @ w.T (+ bias)`` where row r of ``y`` is computed in one fixed order whatever the number of
rows of ``x`` and wherever row r sits among them. MKL's sgemm is not like that: on the machine
measured it runs the last ``M % 4`` rows of a product of fewer than 12 rows through another
kernel, so the same token's projection rounds differently in a 1-row decode step, a 5-row
speculative verify and a 16-row batch. Speculative decoding's "identical output" needs the
verify rows to be the decode rows bit for bit (``tests/kernels/test_batch_invariance.py``), so
the float32 linears take this kernel in batch-invariant mode (``layers.linear``).

The kernel is the packed-GGUF product's many-row kernel (``ggml_f32_panel.h``) with the float32
weights as its panel: 4 x 6 register tiles (3 x 4 on AVX2), each output one accumulator summed in
one order (``ggml_f32_vec.h``) whatever tile it falls in; a K that is not a multiple of the vector
width ends in one zero-padded slice. (The portable C build: 32 scalar lanes per output.)
"""

from __future__ import annotations

import torch

from tokenfab.kernels.cpu import native_library
from tokenfab.kernels.cpu.checks import check_status


def supports(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Whether the kernel takes these tensors (CPU float32, 2-D weight, native library built)."""
    return (x.dtype == torch.float32 and w.dtype == torch.float32 and x.device.type == "cpu"
            and w.device.type == "cpu" and w.dim() == 2 and x.shape[-1] == w.shape[1]
            and native_library() is not None)


def matmul_f32_rowinv(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K] @ w [N, K].T + bias`` in float32, row-invariant (the caller checks ``supports``)."""
    lib = native_library()
    if lib is None or not supports(x, w):
        raise ValueError(f"matmul_f32_rowinv takes CPU float32 x [..., K] and w [N, K] with the native library "
                         f"built; got {x.dtype} {tuple(x.shape)} and {w.dtype} {tuple(w.shape)}")
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    if not w.is_contiguous():
        w = w.contiguous()
    m, (n, k) = x2.shape[0], w.shape
    out = torch.empty(m, n, dtype=torch.float32)
    if m and n:
        if k == 0:
            out.zero_()
        else:
            check_status(lib.matmul_f32_rowinv(x2.data_ptr(), w.data_ptr(), m, n, k, out.data_ptr()),
                         "matmul_f32_rowinv")
    if bias is not None:
        out += bias
    return out.view(*shape[:-1], n)
