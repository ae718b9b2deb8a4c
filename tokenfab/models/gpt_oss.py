"""GPT-OSS (openai/gpt-oss-20b, -120b).

    h = x + Attn(RMSNorm(x));   out = h + MoE(RMSNorm(h))
    Attn: GQA with biases on q/k/v/o, YaRN RoPE (neox halves), one learned "sink" logit per head
          that joins the softmax denominator without a value; layers alternate between a
          sliding window (``config.sliding_window``, 128) and full attention, as
          ``config.layer_types`` says.
    MoE:  logits = x Wr^T + br; the top-k logits, softmaxed among themselves (= softmax top-k,
          renormalized); experts with biases and the clamped SwiGLU
          g' = min(g, limit), u' = clamp(u, -limit, limit), h = (u' + 1) * g' * sigmoid(alpha g').

Checkpoint layout (transformers): ``mlp.router.{weight,bias}``; ``mlp.experts.gate_up_proj``
[E, H, 2I] with gate and up *interleaved* along the last dim (even columns gate, odd up),
``gate_up_proj_bias`` [E, 2I] interleaved alike, ``down_proj`` [E, I, H], ``down_proj_bias``
[E, H]; ``self_attn.sinks`` [heads]. OpenAI's released checkpoints hold the expert matrices in
MXFP4 instead: ``{gate_up,down}_proj_blocks`` [E, rows, cols / 32, 16] uint8 (two E2M1 values
a byte, low nibble first) with ``_scales`` [E, rows, cols / 32] uint8 (E8M0: 2^(s - 127) per
32 values), rows x cols being the [out, in] matrix. With ``quantization_config.quant_method``
"mxfp4" (OpenAI's releases) they stay packed: ``tokenfab.quant.mxfp4`` gives each FusedMoE MXFP4
experts that take the blocks, scales and biases as stored and run the W4A16 MoE kernel. Blocks
in a checkpoint without that config are dequantized to the model dtype at load.

KV cache memory with sliding windows: every layer, sliding or not, keeps every block of a
sequence until the sequence finishes; the block manager (not this file) frees nothing that
falls out of a window, so sliding layers cost as much cache as full ones. Freeing blocks
wholly outside every window needs per-layer-group block tables (the full-attention layers
still read them all); that is the block manager's to do.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from tokenfab.layers.attention import Attention
from tokenfab.layers.moe import FusedMoE, load_moe_tensor
from tokenfab.layers.tp_split import heads_split
from tokenfab.models.llama import DecoderLayer, LlamaAttention, layer_sliding_window
from tokenfab.models.mixtral import MoECausalLM

# E2M1 values of the 16 FP4 codes (sign bit 3, exponent bits 2-1, mantissa bit 0).
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype,
                     device: torch.device | None = None) -> torch.Tensor:
    """MXFP4 -> dense: blocks [..., G, 16] uint8, scales [..., G] uint8 -> [..., G * 32] in ``dtype``.

    Byte b of a block holds values 2b (low nibble) and 2b + 1 (high nibble); the 32 values of a
    block share the scale 2^(s - 127). Done one leading slice at a time to bound the fp32 temporaries.
    """
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match")
    device = device or blocks.device
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=device)
    out = torch.empty(*scales.shape[:-1], scales.shape[-1] * 32, dtype=dtype, device=device)
    flat_b = blocks.reshape(-1, *blocks.shape[-2:])
    flat_s = scales.reshape(-1, scales.shape[-1])
    flat_o = out.view(-1, out.shape[-1])
    rows = max(1, (1 << 22) // (scales.shape[-1] * 32))  # ~16 MB of fp32 per slice
    for r0 in range(0, flat_b.shape[0], rows):
        b = flat_b[r0 : r0 + rows].to(device=device, dtype=torch.uint8).long()
        s = flat_s[r0 : r0 + rows].to(device=device, dtype=torch.int32)
        vals = torch.stack((lut[b & 0x0F], lut[b >> 4]), dim=-1).flatten(-2)  # [n, G, 32]
        vals = torch.ldexp(vals, (s - 127).unsqueeze(-1).float())
        flat_o[r0 : r0 + rows] = vals.flatten(-2).to(dtype)
    return out


def deinterleave_gate_up(w: torch.Tensor) -> torch.Tensor:
    """[..., 2I, X] with gate/up rows alternating -> [..., 2I, X] with the gate rows first."""
    return torch.cat((w[..., 0::2, :], w[..., 1::2, :]), dim=-2)


class GptOssAttention(LlamaAttention):
    def __init__(self, config: Any, layer_idx: int, max_position: int) -> None:
        super().__init__(config, layer_idx, max_position)
        self.attn = Attention(
            self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim**-0.5,
            sliding_window=layer_sliding_window(config, layer_idx), use_sinks=True,
        )
        # tensor parallel: one sink per query head, split with the heads (None at TP 1)
        self.attn.tp_split = heads_split(config.num_attention_heads)


_EXPERTS = re.compile(
    r"^(?P<mod>.+\.mlp)\.experts\.(?P<proj>gate_up_proj|down_proj)(?P<suffix>_bias|_blocks|_scales)?$"
)


class GptOssForCausalLM(MoECausalLM):
    def __init__(self, config: Any, max_position: int | None = None) -> None:
        max_position = max_position or config.max_position_embeddings

        def make_layer(i: int) -> nn.Module:
            moe = FusedMoE(
                config.hidden_size, config.intermediate_size, config.num_local_experts, config.num_experts_per_tok,
                renormalize=True, router_bias=True, expert_bias=True, activation="swiglu_oai",
                swiglu_alpha=config.swiglu_alpha, swiglu_limit=config.swiglu_limit,
            )
            return DecoderLayer(config, GptOssAttention(config, i, max_position), moe)

        super().__init__(config, make_layer)
        self._mxfp4_pending: dict[tuple[str, str], dict[str, torch.Tensor]] = {}

    def remap_checkpoint_name(self, name: str) -> str | None:
        name = name.replace(".mlp.router.", ".mlp.gate.")
        return name.replace(".self_attn.sinks", ".self_attn.attn.sinks")

    def load_checkpoint_tensor(self, name: str, tensor: torch.Tensor) -> list[str] | None:
        m = _EXPERTS.match(name)
        if m is None:
            return None
        mod, proj, suffix = m["mod"], m["proj"], m["suffix"] or ""
        try:
            moe = self.get_submodule(mod)
        except AttributeError:
            return None
        if getattr(moe, "quant_experts", None) is not None:  # packed MXFP4 experts take the tensors as stored
            kind = "w13" if proj == "gate_up_proj" else "w2"
            return load_moe_tensor(self, mod, kind, tensor, suffix=suffix.removeprefix("_") or "weight")
        if suffix == "_bias":
            b = deinterleave_gate_up(tensor.unsqueeze(-1)).squeeze(-1) if proj == "gate_up_proj" else tensor
            return load_moe_tensor(self, mod, "w13_bias" if proj == "gate_up_proj" else "w2_bias", b)
        if suffix in ("_blocks", "_scales"):
            pending = self._mxfp4_pending.setdefault((mod, proj), {})
            pending[suffix] = tensor
            if len(pending) < 2:
                return []
            del self._mxfp4_pending[(mod, proj)]
            w = dequantize_mxfp4(pending["_blocks"], pending["_scales"], moe.w13_weight.dtype,
                                 moe.w13_weight.device)  # [E, out, in]
        else:
            w = tensor.transpose(1, 2)  # transformers stores [E, in, out]
        if proj == "gate_up_proj":
            return load_moe_tensor(self, mod, "w13", deinterleave_gate_up(w))
        return load_moe_tensor(self, mod, "w2", w)
