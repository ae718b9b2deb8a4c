"""The W4A16 fused-MoE reference and CPU path (``moe_w4a16``'s kernels' twins).

The reference loops over the experts that received pairs and dequantizes one expert at a time
(rounded to the activation dtype, as the kernels feed the MMA); the CPU path runs the same loop with
each product through the C kernel (``kernels/cpu/w4a16.c``), so no expert is ever dequantized
whole. ``w13_g`` (NVFP4) is one global scale per expert, [E], or one each for gate and up, [E, 2].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tokenfab.kernels.cpu.w4a16 import w4a16_native
from tokenfab.kernels.moe_common import experts_loop_ref
from tokenfab.kernels.moe_gemm import ACTIVATIONS, moe_activation_ref
from tokenfab.kernels.w4a16 import check_w4, dequantize_w4


def _check(hidden, w13_q, w13_s, w2_q, w2_s, topk_weights, topk_ids, w13_g, w2_g, codec, activation) -> tuple:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, not {activation!r}")
    if hidden.dim() != 2 or w13_q.dim() != 3 or w2_q.dim() != 3:
        raise ValueError("fused_experts_w4a16 expects hidden [T, H], packed w13 [E, 2I, H/2], w2 [E, H, I/2]")
    t, h = hidden.shape
    e, two_i = w13_q.shape[:2]
    if two_i % 2 or w2_q.shape[:2] != (e, h):
        raise ValueError(f"packed experts {tuple(w13_q.shape)}, {tuple(w2_q.shape)} do not fit hidden size {h}")
    check_w4(w13_q, w13_s, codec, h)
    check_w4(w2_q, w2_s, codec, two_i // 2)
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != t:
        raise ValueError(f"topk ids {tuple(topk_ids.shape)} / weights {tuple(topk_weights.shape)} for {t} tokens")
    if (w13_g is not None or w2_g is not None) != (codec == "nvfp4") or (w13_g is None) != (w2_g is None):
        raise ValueError("global scales w13_g and w2_g go with the nvfp4 codec, both or neither")
    if w13_g is not None and (tuple(w13_g.shape) not in ((e,), (e, 2)) or tuple(w2_g.shape) != (e,)):
        raise ValueError(f"w13_g must be [{e}] or [{e}, 2] and w2_g [{e}], got {tuple(w13_g.shape)}, "
                         f"{tuple(w2_g.shape)}")
    return t, h, e, two_i // 2


def _dequant_linear(x, q, s, g, b, codec: str, k: int) -> torch.Tensor:
    """x @ dequant(W).T in fp32 (W rounded to x's dtype), times the global scale, plus the bias."""
    y = F.linear(x.float(), dequantize_w4(q, s, codec, k).to(x.dtype).float())
    if g is not None:
        y = y * g.float()
    return y + b.float() if b is not None else y


def _native_linear(x, q, s, g, b, codec: str, k: int) -> torch.Tensor:
    """The same product through the C kernel (fp32 out, packed weights decoded a row at a time)."""
    y = w4a16_native(x, q, s, g, b, codec, k, out_dtype=torch.float32)
    return y if y is not None else _dequant_linear(x, q, s, g, b, codec, k)


def _experts_loop(linear, hidden, w13_q, w13_s, w2_q, w2_s, topk_weights, topk_ids, w13_bias, w2_bias, w13_g, w2_g,
                  codec, activation, swiglu_alpha, swiglu_limit) -> torch.Tensor:
    _, h, num_experts, inter = _check(hidden, w13_q, w13_s, w2_q, w2_s, topk_weights, topk_ids, w13_g, w2_g, codec,
                                      activation)
    k = topk_ids.shape[1]

    def expert(e: int, pairs: torch.Tensor) -> torch.Tensor:
        g13, g2, b13, b2 = (None if v is None else v[e] for v in (w13_g, w2_g, w13_bias, w2_bias))
        if g13 is not None and g13.numel() == 2:  # gate and up scales: one per row
            g13 = g13.float().repeat_interleave(inter)
        gu = linear(hidden[pairs // k], w13_q[e], w13_s[e], g13, b13, codec, h)
        act = moe_activation_ref(gu, activation, swiglu_alpha, swiglu_limit).to(hidden.dtype)
        return linear(act, w2_q[e], w2_s[e], g2, b2, codec, inter)

    return experts_loop_ref(hidden, topk_weights, topk_ids, num_experts, expert)


def fused_experts_w4a16_ref(
    hidden: torch.Tensor,
    w13_q: torch.Tensor,
    w13_s: torch.Tensor,
    w2_q: torch.Tensor,
    w2_s: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    w13_g: torch.Tensor | None = None,
    w2_g: torch.Tensor | None = None,
    codec: str = "int4",
    activation: str = "silu",
    swiglu_alpha: float = 1.702,
    swiglu_limit: float = 7.0,
) -> torch.Tensor:
    """hidden [T, H] -> [T, H]: ``fused_experts_ref`` with each expert's weights dequantized when
    it is reached (rounded to the activation dtype, as the kernel feeds the MMA); global scales and
    biases applied to the fp32 products."""
    return _experts_loop(_dequant_linear, hidden, w13_q, w13_s, w2_q, w2_s, topk_weights, topk_ids, w13_bias,
                         w2_bias, w13_g, w2_g, codec, activation, swiglu_alpha, swiglu_limit)


def fused_experts_w4a16_native(*args, **kwargs) -> torch.Tensor:
    """The CPU path: the reference's per-expert loop with each product through the C kernel
    (``kernels/cpu/w4a16.c``), so no expert is ever dequantized whole."""
    return _experts_loop(_native_linear, *_bind(*args, **kwargs))


def _bind(hidden, w13_q, w13_s, w2_q, w2_s, topk_weights, topk_ids, w13_bias=None, w2_bias=None, w13_g=None,
          w2_g=None, codec="int4", activation="silu", swiglu_alpha=1.702, swiglu_limit=7.0) -> tuple:
    return (hidden, w13_q, w13_s, w2_q, w2_s, topk_weights, topk_ids, w13_bias, w2_bias, w13_g, w2_g, codec,
            activation, swiglu_alpha, swiglu_limit)
