"""MXFP4 experts (GPT-OSS, ``quant_method: "mxfp4"``), kept packed: uint8 codes and E8M0 scales.

OpenAI's checkpoints hold each MoE layer's expert matrices as ``{gate_up,down}_proj_blocks``
uint8 [E, rows, K/32, 16] (two E2M1 codes a byte, low nibble first) and ``_scales`` uint8
[E, rows, K/32] (2^(s - 127) per 32 values), rows x K being the [out, in] matrix; gate_up's rows
alternate gate/up. Only the experts are MXFP4 (``modules_to_not_convert``: attention, router,
embeddings, lm_head stay bf16), so this method quantizes nothing but FusedMoE experts.

The experts module stores the blocks as [E, rows, K/2] bytes (a free reshape) with gate_up's
rows de-interleaved (gate rows first, as FusedMoE stacks them: rows are permuted, the packing
along K is untouched) and runs ``moe_w4a16`` with the ``mxfp4`` codec: 4.25 bits a weight
instead of 16, the E8M0 scale adding 1/4 bit.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenfab.kernels.moe_w4a16 import fused_experts_w4a16_eager
from tokenfab.quant.base import QuantizedModule, QuantMethod, check_shape
from tokenfab.quant.config import UnsupportedQuantization, register_quant_method, skipped_modules


def deinterleave_rows(t: torch.Tensor) -> torch.Tensor:
    """[E, 2I, ...] with gate/up rows alternating -> gate rows first, then up rows."""
    return torch.cat((t[:, 0::2], t[:, 1::2]), dim=1)


class Mxfp4Experts(QuantizedModule):
    """A FusedMoE's experts in MXFP4: ``w13_q`` [E, 2I, H/2], ``w13_s`` [E, 2I, H/32], ``w2_q``
    [E, H, I/2], ``w2_s`` [E, H, I/32] uint8, optional biases in the model dtype."""

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        e, h, i = moe.num_local_experts, moe.hidden_size, moe.intermediate_size  # this EP rank's slots
        if h % 32 or i % 32:
            raise ValueError(f"MXFP4 experts need hidden ({h}) and intermediate ({i}) sizes that are multiples of 32")
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, i
        self.activation, self.swiglu_alpha, self.swiglu_limit = moe.activation, moe.swiglu_alpha, moe.swiglu_limit
        u8 = torch.uint8
        self.register_buffer("w13_q", torch.zeros(e, 2 * i, h // 2, dtype=u8))
        self.register_buffer("w13_s", torch.zeros(e, 2 * i, h // 32, dtype=u8))
        self.register_buffer("w2_q", torch.zeros(e, h, i // 2, dtype=u8))
        self.register_buffer("w2_s", torch.zeros(e, h, i // 32, dtype=u8))
        has_bias = moe.w13_bias is not None
        dtype = moe.w13_weight.dtype
        self.register_buffer("w13_bias", torch.zeros(e, 2 * i, dtype=dtype) if has_bias else None)
        self.register_buffer("w2_bias", torch.zeros(e, h, dtype=dtype) if has_bias else None)
        self.expect(("w13.blocks", "w13.scales", "w2.blocks", "w2.scales"), (None,))
        if has_bias:
            self.expect(("w13.bias", "w2.bias"), (None,))

    def num_weight_params(self) -> int:
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        return e * 3 * i * h + (e * (2 * i + h) if self.w13_bias is not None else 0)

    def load_expert(self, kind: str, suffix: str, tensor: torch.Tensor, expert: int | None) -> None:
        """Stacked checkpoint tensors: kind "w13" (gate_up, rows interleaved) or "w2" (down); suffix
        "blocks" [E, rows, K/32, 16], "scales" [E, rows, K/32] or "bias" [E, rows]."""
        if kind not in ("w13", "w2") or expert is not None:
            raise ValueError(f"MXFP4 experts take stacked gate_up/down tensors, not {kind} of expert {expert}")
        dst = {"blocks": f"{kind}_q", "scales": f"{kind}_s", "bias": f"{kind}_bias"}.get(suffix)
        buf = getattr(self, dst) if dst else None
        if buf is None:
            raise ValueError(f"MXFP4 experts have no {kind}.{suffix} tensor")
        if suffix == "blocks":
            if tensor.dtype != torch.uint8 or tensor.dim() != 4 or tensor.shape[-1] != 16:
                raise ValueError(f"{kind} blocks must be uint8 [E, rows, K/32, 16], got {tensor.dtype} "
                                 f"{tuple(tensor.shape)}")
            tensor = tensor.reshape(*tensor.shape[:2], -1)
        elif suffix == "scales" and tensor.dtype != torch.uint8:
            raise ValueError(f"{kind} scales must be uint8 (E8M0), got {tensor.dtype}")
        check_shape(f"{kind} {suffix}", tensor, buf.shape)
        buf.copy_(deinterleave_rows(tensor) if kind == "w13" else tensor)
        self.mark(f"{kind}.{suffix}", None)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts_w4a16_eager(
            x, self.w13_q, self.w13_s, self.w2_q, self.w2_s, topk_weights, topk_ids, self.w13_bias, self.w2_bias,
            None, None, "mxfp4", self.activation, self.swiglu_alpha, self.swiglu_limit,
        )


class Mxfp4Method(QuantMethod):
    """``quant_method: "mxfp4"``: only MoE experts are MXFP4; every linear stays in the model dtype."""

    name = "mxfp4"

    def is_quantized(self, module_name: str) -> bool:
        return module_name.endswith(".experts") and super().is_quantized(module_name)

    def make_linear(self, linear: nn.Module, module_name: str) -> nn.Module:
        return linear

    def make_experts(self, moe: nn.Module, module_name: str) -> nn.Module | None:
        return Mxfp4Experts(moe)

    def bytes_per_param(self) -> float:
        return (16 + 1) / 32  # 32 codes in 16 bytes plus one E8M0 scale

    def describe(self) -> str:
        return "MXFP4 experts (E2M1 + E8M0 per 32), kept packed; W4A16 kernels"


def _factory(qc: dict) -> QuantMethod:
    if qc.get("quant_method") != "mxfp4":
        raise UnsupportedQuantization(f"not an mxfp4 config: {qc.get('quant_method')!r}")
    return Mxfp4Method(skipped_modules(qc, "modules_to_not_convert"))


register_quant_method("mxfp4", _factory)
