"""compressed-tensors ``float-quantized`` FP8 (e.g. GLM-4.5-FP8, llm-compressor FP8 exports).

``quantization_config``: ``quant_method: "compressed-tensors"``, ``format: "float-quantized"`` (or
``naive-quantized``), ``config_groups.*.weights = {type: float, num_bits: 8, strategy: channel |
tensor}``, ``input_activations`` dynamic (per token) or static (per tensor, an ``input_scale``
tensor), and an ``ignore`` list (module names and ``re:`` regexes). Each linear: float8_e4m3fn
``weight`` [N, K] and ``weight_scale`` [N, 1] (channel) or one value (tensor). Runs through the
same FP8 GEMM as block FP8, with one scale per output row and activations quantized per token
(dynamic) or with the static scale. Without ``input_activations`` (weight-only FP8) the activations
stay as they are on CPU and are quantized per token on GPU.
"""

from __future__ import annotations

from torch import nn

from tokenfab.quant.base import QuantMethod
from tokenfab.quant.config import UnsupportedQuantization, register_quant_method
from tokenfab.quant.fp8_block import fp8_linear_like
from tokenfab.quant.fp8_experts import FP8Experts


class CompressedTensorsFP8Method(QuantMethod):
    name = "compressed-tensors-fp8"

    def __init__(self, qc: dict) -> None:
        super().__init__(qc.get("ignore") or [])
        groups = [g for g in (qc.get("config_groups") or {}).values() if g]
        if len(groups) != 1:
            raise UnsupportedQuantization(f"{len(groups)} config_groups; one FP8 group is supported")
        w = groups[0].get("weights") or {}
        if w.get("num_bits") != 8 or w.get("type") != "float":
            raise UnsupportedQuantization(f"weights {w.get('type')}{w.get('num_bits')}; float8 is supported here")
        if w.get("strategy") not in ("channel", "tensor"):
            raise UnsupportedQuantization(f"weight strategy {w.get('strategy')!r}; channel or tensor is supported")
        if not w.get("symmetric", True):
            raise UnsupportedQuantization("asymmetric FP8 weights are not supported")
        act = groups[0].get("input_activations")
        self.static_input = False
        self.act_quant = bool(act)
        if act:
            if act.get("num_bits") != 8 or act.get("type") != "float":
                raise UnsupportedQuantization(f"input activations {act.get('type')}{act.get('num_bits')}; "
                                              "float8 or none is supported")
            self.static_input = not act.get("dynamic", False)
            if self.static_input and act.get("strategy", "tensor") != "tensor":
                raise UnsupportedQuantization("static input scales must be per tensor")
        self.weight_strategy = w["strategy"]

    def make_linear(self, linear: nn.Module, module_name: str) -> nn.Module:
        # the CPU path rounds activations through float8 too: compressed-tensors' declared semantics
        return fp8_linear_like(linear, scheme="channel", static_input=self.static_input,
                               cpu_act_quant=self.act_quant)

    def make_experts(self, moe: nn.Module, module_name: str) -> nn.Module | None:
        if self.static_input:
            raise UnsupportedQuantization("FP8 experts with static input scales are not supported")
        return FP8Experts(moe, scheme="channel")

    def bytes_per_param(self) -> float:
        return 1.0

    def describe(self) -> str:
        act = "static per-tensor" if self.static_input else "dynamic per-token"
        return f"compressed-tensors FP8 ({self.weight_strategy} weight scales, {act} activation scales)"


register_quant_method("compressed-tensors/float-quantized", CompressedTensorsFP8Method)
