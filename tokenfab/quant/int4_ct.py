"""compressed-tensors ``pack-quantized`` INT4 W4A16 (Kimi K2/K2.5), kept packed.

    quantization_config = {"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int",
        "symmetric": true, "strategy": "group", "group_size": 32}, "input_activations": null}},
      "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*", "lm_head"]}

Each quantized linear stores ``weight_packed`` int32 [out, in/8] (value + 8 as a nibble, element i
of a word at bits 4i), ``weight_scale`` [out, in/32] and ``weight_shape`` int32 [2]; the value is
``(nibble - 8) * scale``. Dense linears become ``W4Linear`` (codec "int4"); a FusedMoE's routed
experts (per-expert ``experts.{e}.{gate,up,down}_proj.*`` tensors) become ``Int4Experts``, which
stacks them as bytes and runs ``moe_w4a16``. Modules the ``ignore`` list names stay in the model
dtype (for Kimi: attention, shared experts, dense MLPs and lm_head).

Supported: symmetric group quantization, 4 bits, group size 32, no activation quantization.
Anything else (asymmetric zero points, other group sizes or bit widths, W4A8) is refused with
the variant named.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenfab.kernels.moe_w4a16 import fused_experts_w4a16_eager
from tokenfab.quant.base import QuantizedModule, QuantMethod, check_shape
from tokenfab.quant.config import UnsupportedQuantization, register_quant_method, skipped_modules
from tokenfab.quant.w4_linear import w4_linear_like

GROUP = 32


class Int4Experts(QuantizedModule):
    """A FusedMoE's experts in INT4: ``w13_q`` uint8 [E, 2I, H/2] (gate rows then up rows), ``w13_s``
    [E, 2I, H/32], ``w2_q`` [E, H, I/2], ``w2_s`` [E, H, I/32] (scales in the model dtype)."""

    def __init__(self, moe: nn.Module) -> None:
        super().__init__()
        e, h, i = moe.num_local_experts, moe.hidden_size, moe.intermediate_size  # this EP rank's slots
        if h % GROUP or i % GROUP:
            raise ValueError(f"INT4 experts need hidden ({h}) and intermediate ({i}) sizes that are multiples of 32")
        if moe.w13_bias is not None:
            raise ValueError("INT4 compressed-tensors experts with biases are not supported")
        self.num_experts, self.hidden_size, self.intermediate_size = e, h, i
        self.activation, self.swiglu_alpha, self.swiglu_limit = moe.activation, moe.swiglu_alpha, moe.swiglu_limit
        dtype = moe.w13_weight.dtype
        self.register_buffer("w13_q", torch.zeros(e, 2 * i, h // 2, dtype=torch.uint8))
        self.register_buffer("w13_s", torch.zeros(e, 2 * i, h // GROUP, dtype=dtype))
        self.register_buffer("w2_q", torch.zeros(e, h, i // 2, dtype=torch.uint8))
        self.register_buffer("w2_s", torch.zeros(e, h, i // GROUP, dtype=dtype))
        self.expect(("weight_packed", "weight_scale"), [(kind, x) for kind in ("gate", "up", "down") for x in range(e)])

    def expect(self, suffixes, shards) -> None:  # (kind, expert) pairs name the shards here
        self._expected |= {(f"{kind}.{s}", x) for s in suffixes for kind, x in shards}

    def missing(self) -> list[str]:
        return sorted(f"experts.{x}.{s}" for s, x in self._expected - self._got)

    def num_weight_params(self) -> int:
        return self.num_experts * 3 * self.intermediate_size * self.hidden_size

    def load_expert(self, kind: str, suffix: str, tensor: torch.Tensor, expert: int | None) -> None:
        """Per-expert checkpoint tensors: kind "gate"/"up" [I, H] or "down" [H, I], suffix
        "weight_packed" (int32), "weight_scale" or "weight_shape"."""
        if kind not in ("gate", "up", "down") or expert is None or not 0 <= expert < self.num_experts:
            raise ValueError(f"INT4 experts take per-expert gate/up/down tensors, not {kind} of expert {expert}")
        i, h = self.intermediate_size, self.hidden_size
        rows, k = (h, i) if kind == "down" else (i, h)
        sl = slice(None) if kind == "down" else slice(0, i) if kind == "gate" else slice(i, 2 * i)
        q, s = (self.w2_q, self.w2_s) if kind == "down" else (self.w13_q, self.w13_s)
        if suffix == "weight_packed":
            if tensor.dtype != torch.int32:
                raise ValueError(f"expert {expert} {kind} weight_packed must be int32, got {tensor.dtype}")
            check_shape(f"expert {expert} {kind} weight_packed", tensor, (rows, k // 8))
            q[expert, sl].copy_(tensor.contiguous().view(torch.uint8))
        elif suffix == "weight_scale":
            check_shape(f"expert {expert} {kind} weight_scale", tensor, (rows, k // GROUP))
            s[expert, sl].copy_(tensor)
        elif suffix == "weight_shape":
            if [int(v) for v in tensor.reshape(-1)] != [rows, k]:
                raise ValueError(f"expert {expert} {kind} weight_shape is {tensor.tolist()}, expected [{rows}, {k}]")
        else:
            raise ValueError(f"INT4 experts have no {suffix} tensor (expert {expert} {kind})")
        self._got.add((f"{kind}.{suffix}", expert))

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        return fused_experts_w4a16_eager(
            x, self.w13_q, self.w13_s, self.w2_q, self.w2_s, topk_weights, topk_ids, None, None, None, None, "int4",
            self.activation, self.swiglu_alpha, self.swiglu_limit,
        )


class Int4CTMethod(QuantMethod):
    """compressed-tensors pack-quantized INT4 (W4A16, symmetric, group 32)."""

    name = "compressed-tensors/pack-quantized"

    def make_linear(self, linear: nn.Module, module_name: str) -> nn.Module:
        return w4_linear_like(linear, "int4")

    def make_experts(self, moe: nn.Module, module_name: str) -> nn.Module | None:
        return Int4Experts(moe)

    def bytes_per_param(self) -> float:
        return 0.5 + 2 / GROUP  # a nibble plus a 16-bit scale per 32 weights

    def describe(self) -> str:
        return "compressed-tensors pack-quantized INT4 W4A16 (group 32), kept packed"


def _factory(qc: dict) -> QuantMethod:
    fmt = qc.get("format")
    groups = qc.get("config_groups") or {}
    if not groups:
        raise UnsupportedQuantization("no config_groups")
    for gname, group in groups.items():
        group = group or {}
        w = group.get("weights") or {}
        gfmt = group.get("format") or fmt
        if gfmt not in (None, "pack-quantized"):
            raise UnsupportedQuantization(f"{gname}: format {gfmt!r} (supported: pack-quantized)")
        want = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP}
        bad = {k: w.get(k) for k, v in want.items() if w.get(k) != v}
        if bad:
            raise UnsupportedQuantization(f"{gname}: weights {bad} (supported: 4-bit symmetric int, group size 32)")
        if group.get("input_activations"):
            raise UnsupportedQuantization(f"{gname}: quantized input activations (W4A8); supported: W4A16")
        targets = group.get("targets") or ["Linear"]
        if targets != ["Linear"]:
            raise UnsupportedQuantization(f"{gname}: targets {targets} (supported: [\"Linear\"])")
    return Int4CTMethod(skipped_modules(qc, "ignore"))


register_quant_method("compressed-tensors/pack-quantized", _factory)
