"""Tiny PEFT LoRA adapters on MoE experts (transformers 5's fused 3-D expert parameters, PEFT's
``target_parameters``), made and saved by ``peft`` itself; and the same adapter rewritten per expert (the
layout PEFT wrote for transformers 4 and vLLM reads), from PEFT's documented 3-D layout."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

EXPERT_PARAMS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def make_moe_peft_adapter(base, path: Path, r: int, seed: int, target_parameters: list[str],
                          target_modules: list[str] | None = None, use_rslora: bool = False,
                          scale: float = 0.3, **patterns) -> Path:
    """A PEFT adapter of ``base`` on ``target_parameters`` (and ``target_modules``) with random A and B, saved;
    ``patterns``: ``rank_pattern`` / ``alpha_pattern``."""
    import peft

    cfg = peft.LoraConfig(r=r, lora_alpha=2 * r, target_modules=target_modules or [],
                          target_parameters=target_parameters, lora_dropout=0.0, use_rslora=use_rslora,
                          init_lora_weights=False, task_type="CAUSAL_LM", **patterns)
    model = peft.get_peft_model(copy.deepcopy(base), cfg)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    model.save_pretrained(str(path))
    return path


def per_expert_copy(src: Path, dst: Path, num_experts: int, hidden: int, inter: int,
                    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"), block: str | None = None,
                    v4_config: bool = False) -> Path:
    """``src`` (PEFT's 3-D layout on gate_up_proj and down_proj) rewritten as one plain LoRA pair per expert and
    projection, ``<block>.experts.<e>.<gate|up|down name>``. PEFT's layout (``ParamWrapper``): lora_A [r*E, in],
    expert e's rows e*r .. e*r + r; lora_B [out, r*E] viewed as [out, r, E], expert e's [:, :, e]; the gate_up
    pair's B rows are gate's then up's, its A shared by both. ``block``: the MoE block's last name in the copy
    (Mixtral's transformers-4 ``block_sparse_moe``); ``v4_config``: the config as PEFT wrote it for transformers 4
    (the expert projections in ``target_modules``, no ``target_parameters``), which PEFT itself converts on load."""
    cfg = json.loads((src / "adapter_config.json").read_text())
    r = cfg["r"]
    out: dict[str, torch.Tensor] = {}
    with safe_open(str(src / "adapter_model.safetensors"), "pt") as f:
        for key in f.keys():  # noqa: SIM118
            t = f.get_tensor(key)
            module = key.rsplit(".", 2)[0]  # without .lora_A.weight
            if ".experts" not in module:
                out[key] = t
                continue
            if not key.endswith("lora_A.weight"):
                continue
            block_path = module[: module.index(".experts")]
            if block is not None:
                block_path = f"{block_path.rpartition('.')[0]}.{block}"
            a = t.reshape(num_experts, r, -1)
            b = f.get_tensor(key.replace("lora_A", "lora_B"))
            b = b.reshape(b.shape[0], r, num_experts).permute(2, 0, 1)
            if a.shape[2] == hidden and b.shape[1] == 2 * inter:  # gate_up_proj
                parts = {names[0]: b[:, :inter], names[1]: b[:, inter:]}
            else:
                parts = {names[2]: b}
            for leaf, bb in parts.items():
                for e in range(num_experts):
                    out[f"{block_path}.experts.{e}.{leaf}.lora_A.weight"] = a[e].clone()
                    out[f"{block_path}.experts.{e}.{leaf}.lora_B.weight"] = bb[e].clone()
    dst.mkdir(parents=True, exist_ok=True)
    if v4_config:
        cfg["target_modules"] = sorted(set(cfg.get("target_modules") or []) | set(names))
        cfg["target_parameters"] = None
    (dst / "adapter_config.json").write_text(json.dumps(cfg))
    save_file(out, str(dst / "adapter_model.safetensors"))
    return dst
