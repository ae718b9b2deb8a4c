"""Adapters for `tokenfab bench lora`: PEFT LoRA adapters written by ``peft`` itself onto a transformers model
of the served model's architecture (the bundled GGUF's config, or a model folder's ``config.json``), with random
but deterministic weights (each adapter its own seed). Only the adapter files are kept; the base weights the
transformers model was built with are random and never saved."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tokenfab.loader.bundled import bundled_model_path
from tokenfab.loader.gguf import load_gguf

ATTENTION_AND_MLP = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def base_config(model: str | None) -> Any:
    """The transformers config of ``model``: a folder with config.json, a .gguf file, or None (the bundled model)."""
    import transformers

    path = Path(model) if model is not None else bundled_model_path()
    if path.suffix == ".gguf":
        return load_gguf(path).config
    return transformers.AutoConfig.from_pretrained(str(path))


def write_adapters(model: str | None, out_dir: Path, count: int, rank: int, seed: int = 0,
                   targets: list[str] | None = None, scale: float = 0.02) -> list[tuple[str, Path]]:
    """``count`` PEFT adapters of rank ``rank`` on ``targets`` (default: every attention and MLP projection),
    saved as ``out_dir/lora<i>`` by ``save_pretrained``; A and B drawn from N(0, scale^2) with seed ``seed + i``.
    Returns (name, folder) pairs."""
    import peft
    import torch
    import transformers

    config = base_config(model)
    with torch.device("cpu"):
        base = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    lora_config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets or ATTENTION_AND_MLP,
                                  lora_dropout=0.0, init_lora_weights=False, task_type="CAUSAL_LM")
    peft_model = peft.get_peft_model(base, lora_config)
    out = []
    for i in range(count):
        g = torch.Generator().manual_seed(seed + i)
        with torch.no_grad():
            for name, p in sorted(peft_model.named_parameters()):
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * scale)
        folder = out_dir / f"lora{i}"
        peft_model.save_pretrained(str(folder))
        out.append((f"lora{i}", folder))
    return out
