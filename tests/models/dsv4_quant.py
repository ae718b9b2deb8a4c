"""A tiny DeepSeek-V4 saved in the released quantized layout (DeepSeek-V4-Flash), written from the format's
definition rather than from our loader, and the dequantized twin the tests compare against.

The layout (config.json and tensors), as DeepSeek-V4-Flash ships it and as transformers 5.24 reads it
(``integrations/finegrained_fp8.py``: ``.scale`` renamed to ``weight_scale_inv``; FP4 experts when
``expert_dtype == "fp4"``; ``DeepseekV4PreTrainedModel._keep_in_fp32_modules`` for the BF16 compressor and
indexer projections) and vLLM reads it (``DeepseekV4FP8Config``):

- ``quantization_config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
  "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}`` and ``"expert_dtype": "fp4"`` at the top level
  (V4.1 moves ``expert_dtype`` into ``quantization_config``; both are read).
- FP8 linears (attention ``wq_a wq_b wkv wo_a wo_b``, the indexer's ``wq_b``, the shared expert's
  ``w1 w2 w3``): ``.weight`` float8_e4m3fn [N, K] and ``.scale`` float8_e8m0fnu [ceil(N/128), ceil(K/128)],
  ``w = q * scale[n // 128, k // 128]``, each scale a power of two (ue8m0) covering the block's amax / 448.
- Routed experts ``ffn.experts.{e}.w{1,2,3}``: ``.weight`` int8 [N, K/2], two E2M1 codes a byte (element 2j
  in the low nibble), and ``.scale`` float8_e8m0fnu [N, K/32], ``w = e2m1(code) * 2^(byte - 127)``.
- Not quantized: embedding, head, norms, mHC, the router (``ffn.gate``), the compressors' ``wkv``/``wgate``
  and the indexer's ``weights_proj``.
- DeepSeek's own names with no ``model.`` prefix: ``embed.weight``, ``layers.{i}...``, ``norm.weight``,
  ``head.weight``, ``hc_head_{fn,base,scale}``; the MTP layer under ``mtp.0.`` in its own shard, quantized like
  a block (its ``e_proj``/``h_proj`` FP8 here: our loader reads which ones are from the tensors).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from tests.models.dsv4_tiny import save_tiny_dsv4

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
FP8_MAX = 448.0
QUANT_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
    "scale_fmt": "ue8m0",
}
FP8_LINEARS = (
    "attn.wq_a",
    "attn.wq_b",
    "attn.wkv",
    "attn.wo_a",
    "attn.wo_b",
    "attn.indexer.wq_b",
    "shared_experts.w1",
    "shared_experts.w2",
    "shared_experts.w3",
    ".e_proj",
    ".h_proj",
)


def _pow2_at_least(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= x (x > 0), as float32."""
    return torch.exp2(torch.ceil(torch.log2(x)))


def quantize_fp8_block(w: torch.Tensor, ue8m0: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (float8_e4m3fn [N, K], scales [ceil(N/128), ceil(K/128)]): each 128x128 block (edge blocks
    zero-padded) scaled by the power of two at least its amax / 448 (float8_e8m0fnu), or by amax / 448
    itself (float32, ``ue8m0=False``: V4-Flash-Base)."""
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    padded = torch.nn.functional.pad(w.float(), (0, kb * 128 - k, 0, nb * 128 - n)).view(nb, 128, kb, 128)
    scale = padded.abs().amax((1, 3)).clamp_min(1e-30) / FP8_MAX
    scale = _pow2_at_least(scale) if ue8m0 else scale
    q = (padded / scale[:, None, :, None]).view(nb * 128, kb * 128)[:n, :k]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.to(torch.float8_e8m0fnu) if ue8m0 else scale


def dequantize_fp8_block(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    s = scale.float().repeat_interleave(128, 0).repeat_interleave(128, 1)
    return q.float() * s[: q.shape[0], : q.shape[1]]


def quantize_fp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (int8 [N, K/2] packed E2M1 codes, float8_e8m0fnu [N, K/32]): each group of 32 along K scaled
    by the power of two at least its amax / 6, each value rounded to the nearest E2M1 value."""
    n, k = w.shape
    groups = w.float().view(n, k // 32, 32)
    scale = _pow2_at_least(groups.abs().amax(-1).clamp_min(1e-30) / 6.0)
    x = (groups / scale[..., None]).reshape(n, k)
    codes = (x[..., None] - E2M1).abs().argmin(-1).to(torch.uint8)  # ties go to the first (positive) code
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return packed.view(torch.int8), scale.to(torch.float8_e8m0fnu)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    b = packed.view(torch.uint8).long()
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)
    return E2M1[codes] * scale.float().repeat_interleave(32, -1)


def official_name(name: str) -> str:
    """transformers' save_pretrained names -> DeepSeek's (no ``model.`` prefix, ``embed``, ``hc_head_*``)."""
    name = name.removeprefix("model.")
    if name == "embed_tokens.weight":
        return "embed.weight"
    if name.startswith("hc_head.hc_"):
        return "hc_head_" + name.removeprefix("hc_head.hc_")
    return name


def quant_kind(name: str, expert_dtype: str = "fp4") -> str | None:
    """ "fp8", "fp4" or None (kept in full precision) for an official tensor name."""
    if not name.endswith(".weight"):
        return None
    module = name.removesuffix(".weight")
    if ".ffn.experts." in module:
        return expert_dtype
    return "fp8" if module.endswith(FP8_LINEARS) else None


def quantize_official(tensors: dict[str, torch.Tensor], expert_dtype: str = "fp4") -> tuple[dict, dict]:
    """Official float tensors -> (the quantized official tensors, the dequantized ones by the same names)."""
    official: dict[str, torch.Tensor] = {}
    twin: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        kind = quant_kind(name, expert_dtype)
        if kind is None:
            official[name], twin[name] = t, t
            continue
        q, s = quantize_fp8_block(t, ue8m0=expert_dtype == "fp4") if kind == "fp8" else quantize_fp4(t)
        official[name], official[name.removesuffix("weight") + "scale"] = q, s
        twin[name] = dequantize_fp8_block(q, s) if kind == "fp8" else dequantize_fp4(q, s)
    return official, twin


def quantize_mtp_shard(path: Path, twin_dir: Path) -> dict[str, torch.Tensor]:
    """Quantize ``path/mtp.safetensors`` (``dsv4_tiny.save_tiny_dsv4_mtp``'s float MTP layer) in place, its
    dequantized twin into ``twin_dir/mtp.safetensors``; returns the quantized tensors."""
    official, twin = quantize_official(load_file(str(Path(path) / "mtp.safetensors")))
    save_file(official, str(Path(path) / "mtp.safetensors"), metadata={"format": "pt"})
    save_file(twin, str(Path(twin_dir) / "mtp.safetensors"), metadata={"format": "pt"})
    return official


def save_tiny_dsv4_quantized(
    path: Path, seed: int = 0, expert_dtype: str = "fp4", expert_dtype_in_qc: bool = False, **overrides: Any
) -> tuple[dict[str, torch.Tensor], Path]:
    """Save the tiny DeepSeek-V4 (``dsv4_tiny``) quantized in the official layout into ``path`` and its
    dequantized twin (every quantized tensor replaced by ``q * scale``, float32, transformers' names) into
    ``path/../<name>-dequantized``. Returns (the official tensors written, the twin's directory).

    ``expert_dtype="fp8"``: V4-Flash-Base's variant as vLLM describes it (FP8 block experts, float32 scale
    grids everywhere); ``expert_dtype_in_qc``: ``expert_dtype`` inside ``quantization_config`` (V4.1)."""
    path = Path(path)
    fp32_dir = path.parent / f"{path.name}-fp32"
    save_tiny_dsv4(fp32_dir, seed=seed, **overrides)
    original = load_file(str(fp32_dir / "model.safetensors"))
    names = {official_name(name): name for name in original}
    official, dequantized = quantize_official({off: original[name] for off, name in names.items()}, expert_dtype)
    twin = {name: dequantized[off] for off, name in names.items()}  # transformers' names
    config = json.loads((fp32_dir / "config.json").read_text())
    qc = dict(QUANT_CONFIG)
    if expert_dtype_in_qc:
        qc["expert_dtype"] = expert_dtype  # V4.1's place
    else:
        config["expert_dtype"] = expert_dtype
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": qc}, indent=1))
    save_file(official, str(path / "model.safetensors"), metadata={"format": "pt"})
    twin_dir = path.parent / f"{path.name}-dequantized"
    twin_dir.mkdir(exist_ok=True)
    (twin_dir / "config.json").write_text((fp32_dir / "config.json").read_text())
    save_file(twin, str(twin_dir / "model.safetensors"), metadata={"format": "pt"})
    return official, twin_dir


def load_reference(twin_dir: Path) -> Any:
    """transformers' DeepseekV4ForCausalLM (fp32, eval) on the dequantized twin."""
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(str(twin_dir), dtype=torch.float32).eval()
