"""Test helpers that write tiny checkpoints in the official 4-bit on-disk layouts, from the format
specs (REFERENCES.md "Checkpoint formats"), not from tokenfab's loader:

- ``write_int4_ct_checkpoint``: compressed-tensors ``pack-quantized`` W4A16 (Kimi K2's format):
  ``weight_packed`` int32 [out, in/8] (value + 8 as a nibble, element i at bits 4i),
  ``weight_scale`` [out, in/32], ``weight_shape`` int32 [2]; an ``ignore`` list of names / ``re:``.
- ``write_mxfp4_checkpoint``: GPT-OSS experts as ``*_blocks`` uint8 [E, rows, K/32, 16] (two E2M1
  codes a byte, low nibble first) + ``*_scales`` uint8 E8M0 [E, rows, K/32].
- ``write_nvfp4_checkpoint``: ModelOpt NVFP4: ``weight`` uint8 [N, K/2] (E2M1 pairs), ``weight_scale``
  float8_e4m3fn [N, K/16], ``weight_scale_2`` float32 (global), ``input_scale`` float32;
  ``hf_quant_config.json`` (or ``quantization_config`` with ``quant_method: "modelopt"``).

Each reads a plain checkpoint directory (config.json + model.safetensors, fp32), writes the
quantized one, and returns the dequantized twin: the plain tensors with every quantized weight
replaced by exactly the values its codes encode (a float model loading the twin is the reference).
"""

from __future__ import annotations

import fnmatch
import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from tests.moe_tiny_models import mxfp4_pack, mxfp4_unpack

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
KIMI_IGNORE = ["re:.*self_attn.*", "re:.*shared_experts.*", r"re:.*mlp\.(gate|up|gate_up|down)_proj.*", "lm_head"]


def _copy_aux(src: Path, dst: Path) -> dict:
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    return json.loads((src / "config.json").read_text())


def _ignored(module: str, ignore: list[str]) -> bool:
    for entry in ignore:
        if entry.startswith("re:"):
            if re.match(entry[3:], module):
                return True
        elif module == entry:
            return True
    return False


# ------------------------------------------------------------------ compressed-tensors INT4


def int4_quantize(w: torch.Tensor, scale_dtype: torch.dtype = torch.bfloat16):
    """[out, in] -> (weight_packed int32 [out, in/8], weight_scale [out, in/32], dequantized fp32).
    Symmetric group-32 quantization to -8..7 with scale amax / 7.5 (compressed-tensors' minmax)."""
    out_f, in_f = w.shape
    g = w.float().reshape(out_f, in_f // 32, 32)
    scale = (g.abs().amax(-1) / 7.5).clamp(min=1e-8).to(scale_dtype)
    q = torch.round(g / scale.float()[..., None]).clamp(-8, 7).to(torch.int64)
    deq = (q.float() * scale.float()[..., None]).reshape(out_f, in_f)
    nib = (q + 8).reshape(out_f, in_f // 8, 8)
    words = torch.zeros(out_f, in_f // 8, dtype=torch.int64)
    for i in range(8):
        words |= nib[..., i] << (4 * i)
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)  # the bits as a signed int32
    return words, scale, deq


def write_int4_ct_checkpoint(src: Path, dst: Path, ignore: list[str] | None = None,
                             scale_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Every ``*.weight`` of a 2-D linear not in ``ignore`` (module names / ``re:`` regexes; the
    embeddings and norms are never linears here) becomes pack-quantized INT4 (group 32)."""
    ignore = KIMI_IGNORE if ignore is None else ignore
    cfg = _copy_aux(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out, twin = {}, {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        linear = name.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in name and "norm" not in name
        if linear and not module.endswith("mlp.gate") and not _ignored(module, ignore):
            packed, scale, deq = int4_quantize(t, scale_dtype)
            out[module + ".weight_packed"] = packed
            out[module + ".weight_scale"] = scale
            out[module + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int32)
            twin[name] = deq
        else:
            out[name] = t
            twin[name] = t
    save_file(out, str(dst / "model.safetensors"))
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32,
                        "dynamic": False, "actorder": None, "observer": "minmax", "observer_kwargs": {}},
            "input_activations": None, "output_activations": None, "format": "pack-quantized",
        }},
        "ignore": ignore,
        "kv_cache_scheme": None,
    }
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return twin


# ------------------------------------------------------------------ MXFP4 (GPT-OSS)


def write_mxfp4_checkpoint(src: Path, dst: Path) -> dict[str, torch.Tensor]:
    """GPT-OSS's stacked experts (transformers: ``gate_up_proj`` [E, H, 2I], ``down_proj`` [E, I, H],
    [in, out]) stored as OpenAI does: [E, out, in] rows packed to MXFP4 blocks and scales."""
    cfg = _copy_aux(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out, twin = {}, {}
    for name, t in tensors.items():
        if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            blocks, scales = mxfp4_pack(t.transpose(1, 2))
            out[name + "_blocks"], out[name + "_scales"] = blocks, scales
            twin[name] = mxfp4_unpack(blocks, scales).transpose(1, 2).contiguous()
        else:
            out[name] = twin[name] = t
    save_file(out, str(dst / "model.safetensors"))
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return twin


# ------------------------------------------------------------------ NVFP4 (ModelOpt)


def nvfp4_quantize(w: torch.Tensor):
    """[N, K] -> (weight uint8 [N, K/2], weight_scale e4m3 [N, K/16], weight_scale_2 fp32 [], deq fp32).
    Global scale amax / (448 * 6); each 16-block's scale (block amax / 6) / global, rounded to E4M3;
    values rounded to the nearest E2M1 after dividing by scale * global."""
    n, k = w.shape
    g = w.float().reshape(n, k // 16, 16)
    gs = (w.float().abs().amax() / (448.0 * 6.0)).clamp(min=1e-12)
    bs = (g.abs().amax(-1) / 6.0 / gs).clamp(min=2.0**-9).to(torch.float8_e4m3fn)
    q = g / (bs.float()[..., None] * gs)
    code = (q.abs()[..., None] - E2M1).abs().argmin(-1) | ((q < 0).long() << 3)
    deq = torch.cat((E2M1, -E2M1))[code] * bs.float()[..., None] * gs
    code = code.reshape(n, k).to(torch.uint8)
    packed = code[:, 0::2] | (code[:, 1::2] << 4)
    return packed.contiguous(), bs, gs.reshape(()).float(), deq.reshape(n, k)


def write_nvfp4_checkpoint(src: Path, dst: Path, exclude: list[str] | None = None,
                           via_config: bool = False) -> dict[str, torch.Tensor]:
    """Every 2-D linear ``*.weight`` except ``exclude`` (names or globs; default lm_head) becomes NVFP4
    (MoE experts too, one by one: ``experts.{e}.{gate,up,down}_proj.*``). The format is
    declared in ``hf_quant_config.json`` (ModelOpt's export), or with ``via_config`` in config.json's
    ``quantization_config`` (``quant_method: "modelopt"``)."""
    exclude = ["lm_head"] if exclude is None else exclude
    cfg = _copy_aux(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    out, twin = {}, {}
    for name, t in tensors.items():
        module = name.removesuffix(".weight")
        linear = name.endswith(".weight") and t.dim() == 2 and "embed_tokens" not in name
        if linear and not any(module == p or fnmatch.fnmatchcase(module, p) for p in exclude):
            packed, bs, gs, deq = nvfp4_quantize(t)
            out[name], out[module + ".weight_scale"], out[module + ".weight_scale_2"] = packed, bs, gs
            out[module + ".input_scale"] = torch.tensor(1.0 / 448.0)
            twin[name] = deq
        else:
            out[name] = twin[name] = t
    save_file(out, str(dst / "model.safetensors"))
    quant = {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16, "exclude_modules": exclude}
    if via_config:
        cfg["quantization_config"] = {"quant_method": "modelopt", **quant}
    else:
        (dst / "hf_quant_config.json").write_text(json.dumps(
            {"producer": {"name": "modelopt", "version": "0.19.0"}, "quantization": quant}, indent=1))
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    return twin


def with_twin(root: Path, twin: dict[str, torch.Tensor]) -> Path:
    """``root/twin``: the dequantized twin of ``root/plain`` (``write_twin``); returns ``root``."""
    write_twin(root / "plain", root / "twin", twin)
    return root


def write_twin(src: Path, dst: Path, twin: dict[str, torch.Tensor]) -> Path:
    """The dequantized twin as a plain checkpoint directory (config.json without quantization)."""
    cfg = _copy_aux(src, dst)
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
    save_file({k: v.contiguous() for k, v in twin.items()}, str(dst / "model.safetensors"))
    return dst
