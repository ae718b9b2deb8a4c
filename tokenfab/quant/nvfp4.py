"""NVFP4 (NVIDIA ModelOpt), kept packed and run as W4A16.

The format is declared in ``hf_quant_config.json`` (``{"quantization": {"quant_algo": "NVFP4",
"group_size": 16, "exclude_modules": [...], "kv_cache_quant_algo": ...}}``) or in config.json's
``quantization_config`` with ``quant_method: "modelopt"`` (the same keys, flat or under
``quantization``). Each quantized linear stores ``weight`` uint8 [N, K/2] (two E2M1 codes a byte,
low nibble first), ``weight_scale`` float8_e4m3fn [N, K/16], ``weight_scale_2`` float32 (the
global scale) and ``input_scale`` (the activation scale of FP4 activations).

Hopper has no FP4 tensor cores, so the weights are dequantized in registers by the W4A16 GEMM
(``kernels/w4a16.py``, codec "nvfp4") and the activations stay 16-bit: ``input_scale`` is read
and unused. A merged projection (qkv, gate_up) keeps each shard's global scale on its rows. The
kernel's docstring says where a Blackwell FP4 tensor-core path slots in.

Supported: dense linears. ``exclude_modules`` entries are module names or globs (``*``). NVFP4
MoE experts and other ModelOpt algorithms (FP8, W4A8_AWQ) are refused with the variant named;
an FP8 KV-cache setting (``kv_cache_quant_algo``) is not applied (the cache keeps the model
dtype) and is reported in ``describe()``.
"""

from __future__ import annotations

import fnmatch

from torch import nn

from tokenfab.quant.base import QuantMethod
from tokenfab.quant.config import UnsupportedQuantization, register_quant_method
from tokenfab.quant.w4_linear import w4_linear_like


class Nvfp4Method(QuantMethod):
    name = "modelopt"

    def __init__(self, exclude: list[str], kv_cache_algo: str | None = None) -> None:
        super().__init__(exclude)
        self.kv_cache_algo = kv_cache_algo

    def is_quantized(self, module_name: str) -> bool:
        for pat in self.ignore:
            if module_name == pat or module_name.startswith(pat + ".") or fnmatch.fnmatchcase(module_name, pat):
                return False
        return super().is_quantized(module_name)

    def make_linear(self, linear: nn.Module, module_name: str) -> nn.Module:
        return w4_linear_like(linear, "nvfp4")

    def make_experts(self, moe: nn.Module, module_name: str) -> nn.Module | None:
        raise ValueError(f"{module_name}: NVFP4 MoE experts are not supported yet (dense NVFP4 linears are)")

    def bytes_per_param(self) -> float:
        return 0.5 + 1 / 16  # a nibble plus an E4M3 scale per 16 weights

    def describe(self) -> str:
        kv = f"; kv_cache_quant_algo {self.kv_cache_algo} not applied" if self.kv_cache_algo else ""
        return f"ModelOpt NVFP4 (E2M1 + E4M3 per 16 x global), kept packed; W4A16 kernels (no FP4 tensor cores){kv}"


def _factory(qc: dict) -> QuantMethod:
    q = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
    algo = str(q.get("quant_algo", "")).upper()
    if algo != "NVFP4":
        raise UnsupportedQuantization(f"ModelOpt quant_algo {q.get('quant_algo')!r} (supported: NVFP4)")
    group = q.get("group_size", 16)
    if group != 16:
        raise UnsupportedQuantization(f"NVFP4 group_size {group} (supported: 16)")
    exclude = q.get("exclude_modules") or q.get("ignore") or []
    if not isinstance(exclude, list):
        raise UnsupportedQuantization("exclude_modules must be a list")
    return Nvfp4Method([str(e) for e in exclude], q.get("kv_cache_quant_algo"))


register_quant_method("modelopt", _factory)
