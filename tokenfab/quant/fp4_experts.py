"""Block-FP8 checkpoints whose routed experts are FP4 (``expert_dtype: "fp4"``: DeepSeek-V4-Flash/Pro).

On disk (config.json ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size":
[128, 128], "scale_fmt": "ue8m0", "activation_scheme": "dynamic"}`` with ``"expert_dtype": "fp4"`` at the
top level of config.json (V4) or inside ``quantization_config`` (V4.1; :func:`tokenfab.loader.formats.
quantization_config` folds the first into the second, as transformers 5.24's ``DeepseekV4Config`` does):

- every other quantized linear is block FP8 exactly as :mod:`tokenfab.quant.fp8_block` loads it, except
  that the scale grid is named ``.scale`` (:meth:`Fp8ExpertDtypeMethod.checkpoint_name` maps it to
  ``weight_scale_inv``) and is stored as float8_e8m0fnu (a power of two, exact in float32) instead of float32
  (``expert_dtype: "fp8"`` checkpoints, V4-Flash-Base, keep float32 grids and FP8 experts, per vLLM);
- the compressors' ``wkv``/``wgate`` and the indexer's ``weights_proj`` are BF16 (:data:`UNQUANTIZED_LINEARS`),
  as are the embedding, head, norms, mHC and the router;
- each routed expert projection ``experts.{e}.w{1,2,3}`` (gate, down, up) has ``.weight`` int8 [rows, K/2]
  (two E2M1 codes a byte, element 2j in the low nibble; ``float4_e2m1fn_x2`` or uint8 storage are read the
  same) and ``.scale`` float8_e8m0fnu [rows, K/32]: ``w[r, k] = e2m1(code[r, k]) * 2^(scale[r, k // 32] - 127)``.

That is MXFP4 (E2M1 codes, one E8M0 scale per 32 values along K) in a different container from GPT-OSS's
(per expert instead of stacked ``_blocks``/``_scales``, gate and up in separate tensors instead of
interleaved rows). So the experts are :class:`tokenfab.quant.mxfp4.Mxfp4Experts`, the same packed
buffers and the same ``moe_w4a16`` kernels with the ``mxfp4`` codec; only their loading differs.

Sources: transformers 5.24 (``integrations/finegrained_fp8.py``: ``.scale`` -> ``weight_scale_inv``, FP4
experts int8 [N, K/2] with ue8m0 scales at granularity [1, 32], low nibble first in ``_unpack_fp4``) and
vLLM's ``DeepseekV4FP8Config`` (FP4 experts through its MXFP4 MoE method, ``.scale`` of experts ->
``weight_scale``, of other linears -> ``weight_scale_inv``, e8m0 bytes taken as raw exponents). They agree.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from tokenfab.quant.base import check_shape
from tokenfab.quant.config import UnsupportedQuantization, register_quant_method
from tokenfab.quant.fp8_block import FP8BlockMethod
from tokenfab.quant.mxfp4 import Mxfp4Experts

_FP4_STORAGE = tuple(d for d in (torch.int8, torch.uint8, getattr(torch, "float4_e2m1fn_x2", None)) if d)
_SCALE_STORAGE = (torch.float8_e8m0fnu, torch.uint8)
_SCALE_SUFFIXES = ("scale", "weight_scale_inv", "weight_scale")  # the model may have renamed ``.scale``


class PerExpertFp4Experts(Mxfp4Experts):
    """MXFP4 experts loaded one projection of one expert at a time (DeepSeek's layout): kind "gate" (``w1``)
    and "up" (``w3``) fill rows [0, I) and [I, 2I) of ``w13_q``/``w13_s``, "down" (``w2``) fills ``w2_q``/
    ``w2_s``; the scale bytes are the E8M0 exponents as stored."""

    #: checkpoint projection names, for the names of missing tensors
    proj_names = {"gate": "w1", "up": "w3", "down": "w2"}

    def __init__(self, moe: nn.Module) -> None:
        super().__init__(moe)
        if self.w13_bias is not None:
            raise UnsupportedQuantization("FP4 experts with biases are not supported")
        self._expected.clear()
        self.expect(
            [
                f"experts.{e}.{p}.{s}"
                for e in range(self.num_experts)
                for p in self.proj_names.values()
                for s in ("weight", "scale")
            ],
            [None],
        )

    def load_expert(self, kind: str, suffix: str, tensor: torch.Tensor, expert: int | None) -> None:
        if kind not in self.proj_names or expert is None:
            raise ValueError(f"FP4 experts take per-expert gate/up/down tensors, not {kind} of expert {expert}")
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert slot {expert} out of range 0..{self.num_experts - 1}")
        h, i = self.hidden_size, self.intermediate_size
        rows, k = (i, h) if kind != "down" else (h, i)
        lo = i if kind == "up" else 0
        proj = self.proj_names[kind]
        if suffix == "weight":
            if tensor.dtype not in _FP4_STORAGE:
                raise ValueError(
                    f"FP4 expert weight {proj} is {str(tensor.dtype).removeprefix('torch.')}; the "
                    "checkpoint's expert_dtype fp4 stores two E2M1 codes a byte (int8 [rows, K/2])"
                )
            tensor = tensor.view(torch.uint8)
            check_shape(f"FP4 expert weight {proj}", tensor, (rows, k // 2))
            dst = self.w13_q if kind != "down" else self.w2_q
            suffix = "weight"
        elif suffix in _SCALE_SUFFIXES:
            if tensor.dtype not in _SCALE_STORAGE:
                raise ValueError(
                    f"FP4 expert scale {proj} is {str(tensor.dtype).removeprefix('torch.')}; FP4 "
                    "experts take float8_e8m0fnu (ue8m0) scales, one per 32 values"
                )
            tensor = tensor.view(torch.uint8)
            check_shape(f"FP4 expert scale {proj}", tensor, (rows, k // 32))
            if bool((tensor == 0xFF).any()):  # E8M0's one special value
                raise ValueError(f"FP4 expert scale {proj} holds 0xFF, E8M0's NaN")
            dst = self.w13_s if kind != "down" else self.w2_s
            suffix = "scale"
        else:
            raise ValueError(f"FP4 experts do not take {suffix} tensors")
        dst[expert, lo : lo + rows].copy_(tensor)
        self.mark(f"experts.{expert}.{proj}.{suffix}", None)


# Linears DeepSeek-V4's releases keep in BF16 beside the FP8 ones (no scale): the compressors' ``wkv``/``wgate``
# (the attention's and the indexer's) and the indexer's ``weights_proj``. transformers 5.24 lists the same
# modules in ``DeepseekV4PreTrainedModel._keep_in_fp32_modules`` so that its FP8 quantizer skips them.
UNQUANTIZED_LINEARS = ("compressor.wkv", "compressor.wgate", "indexer.weights_proj")
_SCALE_NAME = re.compile(r"\.scale$")


class Fp8ExpertDtypeMethod(FP8BlockMethod):
    """``quant_method: "fp8"`` with an ``expert_dtype``: block FP8 linears (ue8m0 or float32 scale grids named
    ``.scale``) and routed experts in FP4 (:class:`PerExpertFp4Experts`) or block FP8 (``expert_dtype: "fp8"``,
    DeepSeek-V4-Flash-Base: :class:`tokenfab.quant.fp8_experts.FP8Experts`)."""

    def __init__(self, qc: dict) -> None:
        expert_dtype = str(qc.get("expert_dtype")).lower()
        if expert_dtype not in ("fp4", "fp8"):
            raise UnsupportedQuantization(f"expert_dtype {qc.get('expert_dtype')!r} is not supported; fp4 and fp8 are")
        super().__init__({k: v for k, v in qc.items() if k != "expert_dtype"})
        self.ignore += UNQUANTIZED_LINEARS
        self.expert_dtype = expert_dtype
        self.name = f"fp8+{expert_dtype}-experts"

    def checkpoint_name(self, name: str) -> str:
        """DeepSeek's ``{linear}.scale`` is the block grid ``weight_scale_inv`` (a multiplier, like FP8's)."""
        return _SCALE_NAME.sub(".weight_scale_inv", name)

    def make_experts(self, moe: nn.Module, module_name: str) -> nn.Module | None:
        return PerExpertFp4Experts(moe) if self.expert_dtype == "fp4" else super().make_experts(moe, module_name)

    def describe(self) -> str:
        if self.expert_dtype == "fp8":
            return super().describe() + "; block FP8 experts"
        return super().describe() + "; MXFP4 experts (E2M1 + E8M0 per 32), kept packed; W4A16 kernels"


register_quant_method("fp8/expert_dtype", Fp8ExpertDtypeMethod)
