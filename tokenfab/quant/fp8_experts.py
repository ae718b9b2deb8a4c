"""FP8 experts for FusedMoE (the ``quant_experts`` hook of layers/moe.py).

The experts' float8 weights stay stacked as in the plain layer (``w13`` [E, 2I, H]: each expert's
gate rows then its up rows; ``w2`` [E, H, I]) with their scale grids: block FP8 (128x128 blocks per
expert projection; when I is not a multiple of 128 the gate/up grids are kept per row, as in
FP8Linear) or per channel. On GPU (Triton) block-FP8 experts run the W8A8 fused MoE
(``kernels/moe_fp8.py``: activations quantized per token and 128 channels, the float8 experts read
by the grouped GEMMs). On CPU each expert that received tokens is dequantized for its product only
(C kernel for float32; weight-only: transformers' numbers on CPU); per-channel experts on GPU are
dequantized for the call and run the plain fused-experts path.
The weights stay float8 in memory either way.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenfab.kernels._dispatch import backend
from tokenfab.kernels.cpu.fp8_matmul import fp8_dequant_native
from tokenfab.kernels.moe import fused_experts
from tokenfab.kernels.moe_common import experts_loop_ref
from tokenfab.kernels.moe_fp8 import fused_experts_fp8
from tokenfab.kernels.moe_gemm import moe_activation_ref
from tokenfab.kernels.quant import FP8, dequantize_fp8
from tokenfab.quant.base import QuantizedModule, check_shape

BLOCK = 128
_KINDS = {"gate": ("w13", 0), "up": ("w13", 1), "down": ("w2", 0)}
_PROJ = {"gate": "gate_proj", "up": "up_proj", "down": "down_proj"}


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _dequantize_stack(w: torch.Tensor, s: torch.Tensor, group_rows: int, dtype: torch.dtype) -> torch.Tensor:
    """float8 [E, R, K] times scales [E, ceil(R / group_rows), ceil(K / 128) or 1]."""
    _, r, k = w.shape
    full = s.repeat_interleave(group_rows, 1)[:, :r]
    full = full.expand(-1, -1, k) if s.shape[2] == 1 else full.repeat_interleave(BLOCK, 2)[:, :, :k]
    return (w.float() * full).to(dtype)


class FP8Experts(QuantizedModule):
    def __init__(self, moe: nn.Module, scheme: str = "block", ue8m0: bool = False) -> None:
        super().__init__()
        e, i, h = moe.num_local_experts, moe.intermediate_size, moe.hidden_size  # this EP rank's slots
        self.num_experts, self.intermediate_size, self.hidden_size = e, i, h
        self.scheme, self.ue8m0 = scheme, ue8m0
        self.dtype = moe.w13_weight.dtype
        self.activation, self.swiglu_alpha, self.swiglu_limit = moe.activation, moe.swiglu_alpha, moe.swiglu_limit
        if moe.w13_bias is not None:
            raise ValueError("FP8 experts with biases are not supported")
        self.register_buffer("w13", torch.empty(e, 2 * i, h, dtype=FP8))
        self.register_buffer("w2", torch.empty(e, h, i, dtype=FP8))
        if scheme == "block":
            self.group_13 = BLOCK if i % BLOCK == 0 else 1  # gate/up grids stack only on block rows
            rows13 = 2 * i // BLOCK if self.group_13 == BLOCK else 2 * i
            self.register_buffer("w13_scale", torch.empty(e, rows13, _cdiv(h, BLOCK), dtype=torch.float32))
            self.register_buffer("w2_scale", torch.empty(e, _cdiv(h, BLOCK), _cdiv(i, BLOCK), dtype=torch.float32))
            self.group_2 = BLOCK
            scale_suffix = "weight_scale_inv"
        else:
            self.group_13 = self.group_2 = 1
            self.register_buffer("w13_scale", torch.empty(e, 2 * i, 1, dtype=torch.float32))
            self.register_buffer("w2_scale", torch.empty(e, h, 1, dtype=torch.float32))
            scale_suffix = "weight_scale"
        self.scale_suffix = scale_suffix
        self.expect([f"experts.{x}.{_PROJ[k]}.{s}" for x in range(e) for k in _KINDS for s in ("weight", scale_suffix)],
                    [None])

    def load_expert(self, kind: str, suffix: str, tensor: torch.Tensor, expert: int | None) -> None:
        if kind not in _KINDS:
            raise ValueError(f"FP8 experts take per-expert gate/up/down tensors, not {kind!r}")
        if expert is None or not 0 <= expert < self.num_experts:
            raise ValueError(f"expert index {expert} out of range 0..{self.num_experts - 1}")
        which, half = _KINDS[kind]
        i, h = self.intermediate_size, self.hidden_size
        rows, k = (i, h) if which == "w13" else (h, i)
        lo = half * i
        if suffix == "weight":
            check_shape(f"expert {kind} weight", tensor, (rows, k))
            if tensor.dtype != FP8:
                raise ValueError(f"expert {kind} weight is {tensor.dtype}, the quantization_config says float8_e4m3fn")
            getattr(self, which)[expert, lo:lo + rows].copy_(tensor)
        elif suffix == self.scale_suffix:
            scale = getattr(self, f"{which}_scale")[expert]
            t = tensor.float()
            if self.scheme == "block":
                check_shape(f"expert {kind} {suffix}", t, (_cdiv(rows, BLOCK), _cdiv(k, BLOCK)))
                if which == "w2" or self.group_13 == BLOCK:
                    scale[lo // BLOCK: lo // BLOCK + t.shape[0]].copy_(t)
                else:
                    scale[lo:lo + rows].copy_(t.repeat_interleave(BLOCK, 0)[:rows])
            else:
                if t.numel() == 1:
                    t = t.reshape(1, 1).expand(rows, 1)
                elif t.numel() != rows:
                    raise ValueError(f"expert {kind} weight_scale has shape {tuple(t.shape)}, expected ({rows}, 1)")
                scale[lo:lo + rows].copy_(t.reshape(rows, 1))
        else:
            raise ValueError(f"FP8 experts do not take {suffix} tensors")
        self.mark(f"experts.{expert}.{_PROJ[kind]}.{suffix}", None)

    def dequantized(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's expert weights in ``dtype`` (for this call only)."""
        return (_dequantize_stack(self.w13, self.w13_scale, self.group_13, dtype),
                _dequantize_stack(self.w2, self.w2_scale, self.group_2, dtype))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if self.scheme == "block" and self.activation == "silu" and backend(x) == "triton":
            # W8A8 fused MoE: the float8 experts read by the grouped GEMMs, no dequantized copy
            return fused_experts_fp8(x, self.w13, self.w13_scale, self.w2, self.w2_scale, self.group_13,
                                     self.group_2, topk_weights, topk_ids, self.ue8m0)
        if not x.is_cuda and backend(x) != "triton" and not torch.compiler.is_compiling():
            return self._forward_cpu(x, topk_weights, topk_ids)
        w13, w2 = self.dequantized(x.dtype)
        return fused_experts(x, w13, w2, topk_weights, topk_ids, None, None, self.activation,
                             self.swiglu_alpha, self.swiglu_limit)

    def _expert(self, which: str, e: int, native: bool) -> torch.Tensor:
        """One expert's projection dequantized to float32 (the C kernel when ``native``, else torch)."""
        w, s = getattr(self, which)[e], getattr(self, f"{which}_scale")[e]
        group = self.group_13 if which == "w13" else self.group_2
        out = fp8_dequant_native(w, s, group) if native else None
        return out if out is not None else dequantize_fp8(w, s, group, torch.float32)

    def _forward_cpu(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """fused_experts_ref's loop over the experts that received tokens (``experts_loop_ref``), each
        expert dequantized for its product only (never the whole layer)."""
        k = topk_ids.shape[1]
        native = backend(x, native=True) == "native"

        def expert(e: int, pairs: torch.Tensor) -> torch.Tensor:
            gu = F.linear(x[pairs // k].float(), self._expert("w13", e, native))
            act = moe_activation_ref(gu, self.activation, self.swiglu_alpha, self.swiglu_limit).to(x.dtype)
            return F.linear(act.float(), self._expert("w2", e, native))

        return experts_loop_ref(x, topk_weights, topk_ids, self.num_experts, expert)

    def num_weight_params(self) -> int:
        return self.w13.numel() + self.w2.numel()
