"""Writers of FP8 checkpoints in the official on-disk layouts, from the format descriptions
(REFERENCES.md "Checkpoint formats"), not from tokenfab's loader.

- Block FP8 (DeepSeek-V3, Qwen3-FP8): every attention / MLP / expert ``*_proj.weight`` becomes
  float8_e4m3fn with a float32 ``weight_scale_inv`` [ceil(N/128), ceil(K/128)]: the weight is
  zero-padded to whole 128x128 blocks, each block scaled by amax / 448, and the padding dropped.
  Embeddings, norms, the router ``mlp.gate`` and ``lm_head`` stay as they were.
- compressed-tensors float-quantized: float8 ``weight`` with ``weight_scale`` [N, 1] per channel,
  optionally a static per-tensor ``input_scale``.

Each writer also returns the dequantized tensors (q * scale in float32): the "dequantized twin".
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_BLOCK_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                    "weight_block_size": [128, 128]}
QUANTIZED = re.compile(r".*_proj(_with_mqa)?\.weight$")  # attention / MLP / expert projections


def _read_dir(src: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    config = json.loads((src / "config.json").read_text())
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(src.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return config, tensors


def block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] -> (float8 [N, K], float32 scale_inv [ceil(N/128), ceil(K/128)]), w ~ q * scale_inv per block."""
    n, k = w.shape
    nb, kb = -(-n // 128), -(-k // 128)
    padded = torch.zeros(nb * 128, kb * 128)
    padded[:n, :k] = w.float()
    blocks = padded.reshape(nb, 128, kb, 128).permute(0, 2, 1, 3)  # [nb, kb, 128, 128]
    scale = blocks.abs().amax(dim=(2, 3)) / 448.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (blocks / scale[:, :, None, None]).clamp(-448, 448).to(FP8)
    q = q.float().permute(0, 2, 1, 3).reshape(nb * 128, kb * 128)[:n, :k].to(FP8)
    return q.contiguous(), scale.float()


def block_dequantize(q: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    n, k = q.shape
    return q.float() * scale_inv.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]


def _write(dst: Path, config: dict, tensors: dict[str, torch.Tensor], qc: dict | None) -> Path:
    dst.mkdir(parents=True, exist_ok=True)
    cfg = {k: v for k, v in config.items() if k != "quantization_config"}
    if qc is not None:
        cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def write_fp8_block_checkpoint(src: Path, dst: Path, twin: Path | None = None, scale_fmt: str | None = None,
                               quantized: re.Pattern = QUANTIZED) -> dict[str, torch.Tensor]:
    """Rewrite the float checkpoint folder ``src`` (config.json + safetensors, Hugging Face names) as
    block FP8 in ``dst``; with ``twin``, also write the dequantized twin (float32, no
    quantization_config) there. Returns the twin's tensors."""
    config, tensors = _read_dir(Path(src))
    out: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if quantized.match(name) and t.dim() == 2:
            q, s = block_quantize(t)
            out[name], out[name + "_scale_inv"] = q, s
            deq[name] = block_dequantize(q, s)
        else:
            out[name] = deq[name] = t
    qc = dict(FP8_BLOCK_CONFIG, **({"scale_fmt": scale_fmt} if scale_fmt else {}))
    _write(Path(dst), config, out, qc)
    if twin is not None:
        _write(Path(twin), config, {k: v.float().contiguous() for k, v in deq.items()}, None)
    return deq


def ct_fp8_config(static_input: bool, ignore: list[str]) -> dict:
    """compressed-tensors' quantization_config for FP8 weights with per-channel scales."""
    act = {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor" if static_input else "token",
           "dynamic": not static_input}
    return {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
                "num_bits": 8, "type": "float", "symmetric": True, "strategy": "channel", "dynamic": False},
                "input_activations": act}},
            "ignore": ignore}


def write_ct_fp8_checkpoint(src: Path, dst: Path, twin: Path | None = None, static_input: bool = False,
                            input_amax: float = 8.0) -> dict[str, torch.Tensor]:
    """compressed-tensors float-quantized FP8 of the float folder ``src``: each ``*_proj.weight`` ->
    float8 ``weight`` + ``weight_scale`` [N, 1] (amax of the row / 448); with ``static_input``, an
    ``input_scale`` (input_amax / 448) per layer. ``lm_head`` is ignored (kept float)."""
    config, tensors = _read_dir(Path(src))
    out: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if QUANTIZED.match(name) and t.dim() == 2:
            s = (t.float().abs().amax(1, keepdim=True) / 448.0).clamp_min(1e-12)
            q = (t.float() / s).clamp(-448, 448).to(FP8)
            base = name[: -len("weight")]
            out[name], out[base + "weight_scale"] = q, s
            if static_input:
                out[base + "input_scale"] = torch.tensor([input_amax / 448.0])
            deq[name] = q.float() * s
        else:
            out[name] = deq[name] = t
    _write(Path(dst), config, out, ct_fp8_config(static_input, ["lm_head"]))
    if twin is not None:
        _write(Path(twin), config, {k: v.float().contiguous() for k, v in deq.items()}, None)
    return deq
