"""FP8 (e4m3) linear layers and block-FP8 checkpoints (DeepSeek-V3/V3.1/V3.2, Qwen3 FP8 releases).

On disk (``quant_method: "fp8"``, ``weight_block_size: [128, 128]``): each quantized linear has a
float8_e4m3fn ``weight`` [N, K] and a float32 ``weight_scale_inv`` [ceil(N/128), ceil(K/128)],
``w = q * scale_inv[n // 128, k // 128]``. Edge blocks were zero-padded before scaling, so N and K
need not be multiples of 128.

:class:`FP8Linear` holds the float8 weight and a scale grid and multiplies through
``kernels.quant.fp8_linear`` (W8A8 Triton GEMM on GPU; on CPU the layer is dequantized for the
call only). The same class serves the per-channel formats (compressed-tensors FP8, online FP8):
the grid then has one row per output channel and one column (``group_n`` = 1).

Merged projections (qkv, gate_up) stack their shards' rows. When every shard starts on a 128-row
boundary the shards' block grids stack into one grid; otherwise (e.g. q 96 rows + k 32 rows) each
block row is repeated for its 128 output rows (a per-row grid [N, ceil(K/128)], ``group_n`` 1), so
that every row still reads its own shard's scale: 4 bytes per 128 weights more, still the same GEMM.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from tokenfab.kernels.quant import FP8, FP8_MAX, GROUP_K, dequantize_fp8, fp8_linear
from tokenfab.quant.base import QuantMethod, check_shape
from tokenfab.quant.config import UnsupportedQuantization, register_quant_method
from tokenfab.quant.fp8_experts import FP8Experts
from tokenfab.quant.sharded_linear import ShardedQuantLinear

BLOCK = 128


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


class FP8Linear(ShardedQuantLinear):
    """``y = x @ (q * scales).T + bias`` with q float8 [N, K] kept in memory.

    ``scheme``: "block" (128x128 block scales, ``weight_scale_inv``), "channel" (one scale per
    output row, ``weight_scale``, [N, 1] or a per-tensor scalar). ``online``: the checkpoint
    holds float weights and the layer quantizes them as they load. ``static_input``: an
    ``input_scale`` tensor quantizes the activations (per tensor) instead of per token.
    ``act`` / ``cpu_act_quant``: see ``kernels.quant.fp8_linear``.

    Tensor parallel: ``tp_split`` (copied from the layer it replaces, loader/quant_apply.py) says which part of
    each full checkpoint tensor this rank keeps (``_tp_part``); a row-parallel layer all-reduces.
    """

    def __init__(self, in_features: int, shard_sizes: Sequence[int], bias: bool, dtype: torch.dtype,
                 scheme: str = "block", ue8m0: bool = False, online: bool = False,
                 static_input: bool = False, act: str | None = None, cpu_act_quant: bool = False) -> None:
        super().__init__()
        if scheme not in ("block", "channel"):
            raise ValueError(f"scheme must be block or channel, not {scheme!r}")
        shards = self._set_shards(in_features, shard_sizes)
        self.scheme, self.ue8m0, self.online, self.dtype = scheme, ue8m0, online, dtype
        # activations: per token and 128 channels (block), per token, or the static input_scale
        self.act = "static" if static_input else act or ("group" if scheme == "block" else "token")
        self.cpu_act_quant = cpu_act_quant
        n, k = self.out_features, in_features
        kb = _cdiv(k, BLOCK)
        if scheme == "block" and all(o % BLOCK == 0 for o in self.offsets):
            self.group_n, grid = BLOCK, (_cdiv(n, BLOCK), kb)  # one stacked block grid
        elif scheme == "block":
            self.group_n, grid = 1, (n, kb)  # shards not on block rows: a per-row grid
        else:
            self.group_n, grid = 1, (n, 1)
        self.register_buffer("qweight", torch.empty(n, k, dtype=FP8))
        self.register_buffer("weight_scale", torch.empty(grid, dtype=torch.float32))
        self.register_buffer("bias", torch.empty(n, dtype=dtype) if bias else None)
        self.register_buffer("input_scale", torch.zeros(1, dtype=torch.float32) if static_input else None)
        self.expect(["weight"] + ([] if online else ["weight_scale_inv" if scheme == "block" else "weight_scale"])
                    + (["bias"] if bias else []) + (["input_scale"] if static_input else []), shards)

    # ------------------------------------------------------------------ loading

    def _put_scales(self, lo: int, hi: int, grid: torch.Tensor) -> None:
        """Place a shard's scale grid ([ceil(rows/128), kb] block or [rows, 1] channel)."""
        grid = grid.float()
        if self.group_n == BLOCK:
            self.weight_scale[lo // BLOCK: lo // BLOCK + grid.shape[0]].copy_(grid)
        elif self.scheme == "block":
            self.weight_scale[lo:hi].copy_(grid.repeat_interleave(BLOCK, 0)[: hi - lo])
        else:
            self.weight_scale[lo:hi].copy_(grid)

    def _tp_part(self, suffix: str, t: torch.Tensor, shard: int | None) -> torch.Tensor:
        """Tensor parallel: this rank's part of a full checkpoint tensor (weights and 128x128 scale
        grids split on 128-element block boundaries; per-channel scales follow the rows). Online FP8
        quantizes each rank's float part as it arrives."""
        split = self.tp_split
        if suffix == "bias":
            return split.take_bias(t, shard)
        if suffix == "weight":
            return split.take(t, shard, what="weight")
        if suffix == "weight_scale_inv" and self.scheme == "block":
            return split.take(t, shard, unit=BLOCK, what="weight_scale_inv")
        if suffix == "weight_scale" and t.numel() > 1 and split.dim == 0:
            return split.take(t.reshape(-1, 1), shard, what="weight_scale")
        return t  # per-tensor scales, per-channel scales of a row-parallel layer, input_scale

    def _load_rows(self, suffix: str, tensor: torch.Tensor, lo: int, hi: int) -> bool:
        rows, k = hi - lo, self.in_features
        if suffix == "weight":
            check_shape("weight", tensor, (rows, k))
            if tensor.dtype == FP8:
                if self.online:
                    raise ValueError("is already float8; online FP8 quantization takes float weights")
                self.qweight[lo:hi].copy_(tensor)
            elif tensor.is_floating_point() and self.online:
                q, s = quantize_weight(tensor, self.scheme)
                self.qweight[lo:hi].copy_(q)
                self._put_scales(lo, hi, s)
            else:
                raise ValueError(f"is stored as {str(tensor.dtype).removeprefix('torch.')}, but the checkpoint's "
                                 "quantization_config says this layer is float8_e4m3fn")
        elif suffix == "weight_scale_inv" and self.scheme == "block":
            check_shape("weight_scale_inv", tensor, (_cdiv(rows, BLOCK), _cdiv(k, BLOCK)))
            self._put_scales(lo, hi, tensor)
        elif suffix == "weight_scale" and self.scheme == "channel":
            if tensor.numel() == 1:  # per-tensor: one scale for every row
                tensor = tensor.reshape(1, 1).expand(rows, 1)
            elif tensor.numel() != rows:
                raise ValueError(f"weight_scale has shape {tuple(tensor.shape)}, expected ({rows}, 1) (per channel) "
                                 "or one value (per tensor)")
            self._put_scales(lo, hi, tensor.reshape(rows, 1))
        elif suffix == "input_scale" and self.input_scale is not None:
            if tensor.numel() != 1:
                raise ValueError(f"input_scale must be one value (per tensor), got shape {tuple(tensor.shape)}")
            # merged shards share one activation quantization: the largest scale covers them all
            self.input_scale.copy_(torch.maximum(self.input_scale, tensor.float().reshape(1)))
        else:
            return False
        return True

    # ------------------------------------------------------------------ compute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = fp8_linear(x, self.qweight, self.weight_scale, self.group_n, self.bias, self.ue8m0, self.input_scale,
                       self.act, self.cpu_act_quant)
        return self._reduced(y)

    @property
    def weight(self) -> torch.Tensor:
        """The dequantized weight, computed on each access (for layers that read ``.weight``
        directly, e.g. MLA's absorbed ``kv_b_proj``); never stored."""
        return dequantize_fp8(self.qweight, self.weight_scale, self.group_n, self.dtype)

    def num_weight_params(self) -> int:
        return self.out_features * self.in_features

    def extra_repr(self) -> str:
        return (f"in={self.in_features}, out={self.shard_sizes}, scheme={self.scheme}, group_n={self.group_n}, "
                f"act={self.act}, ue8m0={self.ue8m0}, online={self.online}")


def quantize_weight(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Float weight [N, K] -> (float8 [N, K], scales): 128x128 blocks ([ceil(N/128), ceil(K/128)],
    edge blocks zero-padded) or one scale per row ([N, 1]); scale = amax / 448."""
    n, k = w.shape
    wf = w.float()
    if scheme == "channel":
        s = wf.abs().amax(1, keepdim=True).clamp_min(1e-12) / FP8_MAX
        return (wf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8), s
    nb, kb = _cdiv(n, BLOCK), _cdiv(k, GROUP_K)
    padded = torch.nn.functional.pad(wf, (0, kb * BLOCK - k, 0, nb * BLOCK - n)).view(nb, BLOCK, kb, BLOCK)
    s = padded.abs().amax((1, 3)).clamp_min(1e-12) / FP8_MAX
    q = (padded / s[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(nb * BLOCK, kb * BLOCK)[:n, :k]
    return q.to(FP8).contiguous(), s


def fp8_linear_like(linear: nn.Module, **kw) -> FP8Linear:
    """An FP8Linear with ``linear``'s shape (a Linear or a MergedLinear) and dtype."""
    shards = getattr(linear, "shard_sizes", None) or [linear.out_features]
    return FP8Linear(linear.in_features, shards, linear.bias is not None, linear.weight.dtype, **kw)


class FP8BlockMethod(QuantMethod):
    """``quant_method: "fp8"`` with ``weight_block_size: [128, 128]`` and dynamic activations."""

    name = "fp8"

    def __init__(self, qc: dict) -> None:
        super().__init__(qc.get("modules_to_not_convert") or qc.get("ignored_layers") or [])
        block = qc.get("weight_block_size")
        if block is None:
            raise UnsupportedQuantization("per-tensor FP8 (no weight_block_size) is not supported; block FP8 with "
                                          "weight_block_size [128, 128] is")
        if list(block) != [BLOCK, BLOCK]:
            raise UnsupportedQuantization(f"weight_block_size {list(block)} is not supported; [128, 128] is")
        if str(qc.get("fmt", "e4m3")) != "e4m3":
            raise UnsupportedQuantization(f"fmt {qc.get('fmt')!r} is not supported; e4m3 is")
        if str(qc.get("activation_scheme", "dynamic")) != "dynamic":
            raise UnsupportedQuantization(f"activation_scheme {qc.get('activation_scheme')!r} is not supported "
                                          "with block scales; dynamic is")
        self.ue8m0 = qc.get("scale_fmt") == "ue8m0"

    def make_linear(self, linear: nn.Module, module_name: str) -> nn.Module:
        return fp8_linear_like(linear, scheme="block", ue8m0=self.ue8m0)

    def make_experts(self, moe: nn.Module, module_name: str) -> nn.Module | None:
        return FP8Experts(moe, scheme="block", ue8m0=self.ue8m0)

    def bytes_per_param(self) -> float:
        return 1.0 + 4.0 / (BLOCK * BLOCK)

    def describe(self) -> str:
        return "block FP8 (e4m3, 128x128 scales" + (", ue8m0 activation scales)" if self.ue8m0 else ")")


register_quant_method("fp8", FP8BlockMethod)
