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

Supported: dense linears and MoE experts (per-expert tensors; gate and up keep their own global
scales). ``exclude_modules`` entries are module names or globs (``*``). Other ModelOpt algorithms
(FP8, W4A8_AWQ) are refused with the variant named;
with ``kv_cache_quant_algo: "FP8"`` the checkpoint ships per-layer ``self_attn.{k,v}_proj.{k,v}_scale``:
the loader keeps them on the attention layers (``quant/kv_fp8.py``) and ``--kv-cache-dtype fp8`` uses
them (without the flag the cache keeps the model dtype); another KV algorithm is reported, not applied.
"""

from __future__ import annotations

import fnmatch

import torch
from torch import nn

from tokenfab.kernels.moe_w4a16 import fused_experts_w4a16_eager
from tokenfab.quant.base import QuantizedModule, QuantMethod, check_shape
from tokenfab.quant.config import UnsupportedQuantization, register_quant_method, skipped_modules
from tokenfab.quant.w4_linear import w4_linear_like


class Nvfp4Experts(QuantizedModule):
    """A FusedMoE's experts in NVFP4, from per-expert ``experts.{e}.{gate,up,down}_proj.*`` tensors
    (E = this rank's local slots under expert parallelism; ``expert`` in ``load_expert`` is a slot):
    ``w13_q`` uint8 [E, 2I, H/2] (gate rows then up rows), ``w13_s`` E4M3 bits [E, 2I, H/16], ``w13_g``
    float32 [E, 2] (gate's and up's ``weight_scale_2``), ``w2_q`` [E, H, I/2], ``w2_s``, ``w2_g`` [E]."""

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        e, h, i = moe.num_local_experts, moe.hidden_size, moe.intermediate_size  # this EP rank's slots
        if h % 16 or i % 16:
            raise ValueError(f"NVFP4 experts need hidden ({h}) and intermediate ({i}) sizes that are multiples of 16")
        if moe.w13_bias is not None:
            raise ValueError("NVFP4 experts with biases are not supported")
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, i
        self.activation, self.swiglu_alpha, self.swiglu_limit = moe.activation, moe.swiglu_alpha, moe.swiglu_limit
        u8 = torch.uint8
        self.register_buffer("w13_q", torch.zeros(e, 2 * i, h // 2, dtype=u8))
        self.register_buffer("w13_s", torch.zeros(e, 2 * i, h // 16, dtype=u8))
        self.register_buffer("w13_g", torch.ones(e, 2, dtype=torch.float32))
        self.register_buffer("w2_q", torch.zeros(e, h, i // 2, dtype=u8))
        self.register_buffer("w2_s", torch.zeros(e, h, i // 16, dtype=u8))
        self.register_buffer("w2_g", torch.ones(e, dtype=torch.float32))
        self._expected |= {(f"{kind}.{sfx}", x) for kind in ("gate", "up", "down") for x in range(e)
                           for sfx in ("weight", "weight_scale", "weight_scale_2")}

    def missing(self) -> list[str]:
        return sorted(f"experts.{x}.{s}" for s, x in self._expected - self._got)

    def num_weight_params(self) -> int:
        return self.num_experts * 3 * self.intermediate_size * self.hidden_size

    def load_expert(self, kind: str, suffix: str, tensor: torch.Tensor, expert: int | None) -> None:
        if kind not in ("gate", "up", "down") or expert is None or not 0 <= expert < self.num_experts:
            raise ValueError(f"NVFP4 experts take per-expert gate/up/down tensors, not {kind} of expert {expert}")
        i, h = self.intermediate_size, self.hidden_size
        rows, k = (h, i) if kind == "down" else (i, h)
        sl = slice(None) if kind == "down" else slice(0, i) if kind == "gate" else slice(i, 2 * i)
        what = f"expert {expert} {kind} {suffix}"
        if suffix == "weight":
            if tensor.dtype != torch.uint8:
                raise ValueError(f"{what} must be uint8 (two E2M1 codes a byte), got {tensor.dtype}")
            check_shape(what, tensor, (rows, k // 2))
            (self.w2_q if kind == "down" else self.w13_q)[expert, sl].copy_(tensor)
        elif suffix == "weight_scale":
            if tensor.dtype != torch.float8_e4m3fn:
                raise ValueError(f"{what} must be float8_e4m3fn, got {tensor.dtype}")
            check_shape(what, tensor, (rows, k // 16))
            (self.w2_s if kind == "down" else self.w13_s)[expert, sl].copy_(tensor.view(torch.uint8))
        elif suffix == "weight_scale_2":
            if tensor.numel() != 1:
                raise ValueError(f"{what} must be one value, got shape {tuple(tensor.shape)}")
            if kind == "down":
                self.w2_g[expert] = tensor.float().reshape(())
            else:
                self.w13_g[expert, 0 if kind == "gate" else 1] = tensor.float().reshape(())
        elif suffix != "input_scale":  # FP4 activations' scale: W4A16 keeps activations in 16 bits
            raise ValueError(f"NVFP4 experts have no {suffix} tensor ({what})")
        self._got.add((f"{kind}.{suffix}", expert))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts_w4a16_eager(
            x, self.w13_q, self.w13_s, self.w2_q, self.w2_s, topk_weights, topk_ids, None, None, self.w13_g,
            self.w2_g, "nvfp4", self.activation, self.swiglu_alpha, self.swiglu_limit,
        )


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
        return Nvfp4Experts(moe)

    def bytes_per_param(self) -> float:
        return 0.5 + 1 / 16  # a nibble plus an E4M3 scale per 16 weights

    def describe(self) -> str:
        kv = ""
        if self.kv_cache_algo:
            fp8 = str(self.kv_cache_algo).upper() == "FP8"
            kv = ("; FP8 KV-cache scales loaded (used with --kv-cache-dtype fp8)" if fp8
                  else f"; kv_cache_quant_algo {self.kv_cache_algo} not applied")
        return f"ModelOpt NVFP4 (E2M1 + E4M3 per 16 x global), kept packed; W4A16 kernels (no FP4 tensor cores){kv}"


def _factory(qc: dict) -> QuantMethod:
    q = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
    algo = str(q.get("quant_algo", "")).upper()
    if algo != "NVFP4":
        raise UnsupportedQuantization(f"ModelOpt quant_algo {q.get('quant_algo')!r} (supported: NVFP4)")
    group = q.get("group_size", 16)
    if group != 16:
        raise UnsupportedQuantization(f"NVFP4 group_size {group} (supported: 16)")
    exclude = skipped_modules(q, "exclude_modules", "ignore")
    return Nvfp4Method([str(e) for e in exclude], q.get("kv_cache_quant_algo"))


register_quant_method("modelopt", _factory)
