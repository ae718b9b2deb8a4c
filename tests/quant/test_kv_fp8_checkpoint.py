"""FP8 KV-cache scales shipped in checkpoints (tokenfab/quant/kv_fp8.py, loader/weights.py).

A ModelOpt NVFP4 checkpoint with ``kv_cache_quant_algo: "FP8"`` is written from the format (the NVFP4
weights by tests/quant/layouts_w4.py; the KV scales as ModelOpt exports them: a float32 scalar
``model.layers.{i}.self_attn.k_proj.k_scale`` / ``v_proj.v_scale`` per layer, meaning amax / 448, i.e. a
stored value is x / scale). With ``--kv-cache-dtype fp8`` the engine stores with those scales (no
calibration); a value beyond 448 x scale saturates. The other name forms vLLM reads
(``self_attn.k_scale``: compressed-tensors ``kv_cache_scheme``; ``self_attn.attn.k_scale``; the
deprecated ``kv_scale``) go to the same layer; a scale no layer takes is a load error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.quant.layouts_w4 import write_nvfp4_checkpoint
from tests.tiny_models import run_capturing_logits, save_tiny_model, tiny_config
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.loader.errors import ModelLoadError
from tokenfab.quant.kv_fp8 import take_kv_scale

FP8 = torch.float8_e4m3fn
PROMPT = [5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11, 12, 13]


def _engine(path, **kw) -> LLMEngine:
    return LLMEngine(model=str(path), block_size=4, num_kv_blocks=32, max_num_batched_tokens=64, **kw)


def add_kv_scales(ckpt: Path, scales: dict[str, float], algo: str | None = "FP8") -> None:
    """Add scalar float32 KV scales (name -> value) to the checkpoint's safetensors, and declare the
    KV algorithm in its hf_quant_config.json (ModelOpt's ``kv_cache_quant_algo``) when it has one."""
    tensors = load_file(str(ckpt / "model.safetensors"))
    tensors.update({name: torch.tensor(value, dtype=torch.float32) for name, value in scales.items()})
    save_file(tensors, str(ckpt / "model.safetensors"))
    hf_quant = ckpt / "hf_quant_config.json"
    if hf_quant.exists():
        cfg = json.loads(hf_quant.read_text())
        cfg["quantization"]["kv_cache_quant_algo"] = algo
        hf_quant.write_text(json.dumps(cfg, indent=1))


@pytest.fixture(scope="module")
def nvfp4_kv(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("nvfp4_kv")
    save_tiny_model(tiny_config("llama"), root / "plain")
    write_nvfp4_checkpoint(root / "plain", root / "nvfp4")
    # layer 0's key scale is deliberately small (its largest keys saturate); the others are generous
    add_kv_scales(root / "nvfp4", {
        "model.layers.0.self_attn.k_proj.k_scale": 0.002, "model.layers.0.self_attn.v_proj.v_scale": 0.01,
        "model.layers.1.self_attn.k_proj.k_scale": 0.03, "model.layers.1.self_attn.v_proj.v_scale": 0.02,
    })
    return root / "nvfp4"


@pytest.mark.slow  # ~13 s: writing the NVFP4 checkpoint, two engines
def test_nvfp4_checkpoint_kv_scales_are_used(nvfp4_kv):
    ref = _engine(nvfp4_kv)  # auto: the scales load, the cache keeps float32
    attn_ref = ref.model.model.layers[0].self_attn.attn
    assert attn_ref.k_cache.dtype == torch.float32 and attn_ref.k_scale is None
    assert attn_ref.checkpoint_kv_scales == pytest.approx({"k": 0.002, "v": 0.01})
    assert "FP8 KV-cache scales loaded" in ref.model.quant_method.describe()

    fp8 = _engine(nvfp4_kv, kv_cache_dtype="fp8")
    attns = [layer.self_attn.attn for layer in fp8.model.model.layers]
    assert [float(s) for a in attns for s in (a.k_scale, a.v_scale)] == pytest.approx([0.002, 0.01, 0.03, 0.02])
    assert not fp8.runner.kv_calibrating and not any(a.kv_calibrate for a in attns)
    run_capturing_logits(ref, PROMPT, 3)
    tokens, _ = run_capturing_logits(fp8, PROMPT, 3)
    assert len(tokens) == 3
    slots = torch.arange(len(PROMPT))
    for name, scale in (("k", 0.002), ("v", 0.01)):  # layer 0 saw the same inputs in both engines
        exact = getattr(attn_ref, f"{name}_cache").flatten(0, 1)[slots].float()
        stored = getattr(attns[0], f"{name}_cache").flatten(0, 1)[slots].float()
        want = (exact / scale).clamp(-448, 448)  # the definition: saturate, then round to e4m3
        assert ((stored - want).abs() <= want.abs() * 2**-4 + 2**-10).all()
        peak = float(exact.abs().max() / scale)
        assert peak > 448 if name == "k" else peak < 448  # the keys reach the saturation case, the values not
    assert attns[0].k_cache.flatten(0, 1)[slots].float().abs().max() == 448


def test_scale_name_forms_and_errors(tmp_path):
    save_tiny_model(tiny_config("llama"), tmp_path)
    engine = _engine(tmp_path)
    modules = dict(engine.model.named_modules())
    attn = engine.model.model.layers[1].self_attn.attn
    forms = {
        "model.layers.1.self_attn.k_proj.k_scale": ("k", 0.5),   # ModelOpt
        "model.layers.1.self_attn.v_scale": ("v", 0.25),         # compressed-tensors kv_cache_scheme
        "model.layers.1.self_attn.attn.k_scale": ("k", 0.125),   # vLLM's own
    }
    for name, (kind, value) in forms.items():
        assert take_kv_scale(name, torch.tensor(value), modules)
        assert attn.checkpoint_kv_scales[kind] == value
    assert take_kv_scale("model.layers.1.self_attn.kv_scale", torch.tensor([0.1, 0.3]), modules)  # both; max
    assert attn.checkpoint_kv_scales == {"k": pytest.approx(0.3), "v": pytest.approx(0.3)}
    assert not take_kv_scale("model.layers.1.self_attn.k_proj.weight", torch.ones(1), modules)
    with pytest.raises(ValueError, match="positive"):
        take_kv_scale("model.layers.0.self_attn.k_scale", torch.tensor(0.0), modules)
    with pytest.raises(ValueError, match="no attention layer of this model takes it"):
        take_kv_scale("model.layers.0.mlp.k_scale", torch.tensor(1.0), modules)
    add_kv_scales(tmp_path, {"model.layers.7.self_attn.k_scale": 0.1})
    with pytest.raises(ModelLoadError, match="model.layers.7.self_attn.k_scale: no attention layer"):
        _engine(tmp_path)
