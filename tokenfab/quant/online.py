"""``--quantization fp8``: quantize a float checkpoint's linears to FP8 as they load.

"fp8": one scale per output channel (amax / 448 of each row); "fp8-block": 128x128 blocks (the
block-FP8 layout DeepSeek ships). Activations are quantized per token and 128 channels on GPU; on
CPU the layer is dequantized for the call. Embeddings, the LM head, norms and MoE routers stay in
the checkpoint's precision; MoE experts stay plain too (only Linear / MergedLinear layers change).
"""

from __future__ import annotations

from torch import nn

from tokenfab.quant.base import QuantMethod
from tokenfab.quant.fp8_block import BLOCK, fp8_linear_like

ONLINE_METHODS = ("fp8", "fp8-block")


class OnlineFP8Method(QuantMethod):
    def __init__(self, scheme: str) -> None:
        super().__init__()
        self.scheme = scheme
        self.name = "fp8 (online, " + ("per-channel)" if scheme == "channel" else "128x128 blocks)")

    def make_linear(self, linear: nn.Module, module_name: str) -> nn.Module:
        return fp8_linear_like(linear, scheme=self.scheme, online=True)

    def bytes_per_param(self) -> float:
        return 1.0 + (4.0 / (BLOCK * BLOCK) if self.scheme == "block" else 0.0)


def online_quant_method(quantization: str) -> QuantMethod:
    if quantization not in ONLINE_METHODS:
        raise ValueError(f"online quantization must be one of {', '.join(ONLINE_METHODS)}, got {quantization!r}")
    return OnlineFP8Method("channel" if quantization == "fp8" else "block")
