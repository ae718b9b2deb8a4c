"""PEFT LoRA adapters on MoE experts, read for serving: which tensors are expert LoRA, checked against the
model's MoE layers, and read into per-expert (A, B * scale) stacks.

Two layouts are read (``<block>`` is the checkpoint path of an MoE block, e.g. ``model.layers.0.mlp``):

- PEFT's for transformers 5, whose experts are fused 3-D parameters (``LoraConfig(target_parameters=
  ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])``, PEFT's ``ParamWrapper``). Each targeted
  parameter gets one pair ``lora_A`` [r * E, in] and ``lora_B`` [out, r * E]; a second targeted
  parameter of the same module wraps the first, so the keys are ``<block>.experts.lora_A.weight`` and
  ``<block>.experts.base_layer.lora_A.weight`` (one ``.base_layer`` per level of nesting), and which
  parameter each pair belongs to is read from its shapes (gate_up_proj: in H, out 2I; down_proj: in I,
  out H -- never the same). Expert e's factors are rows ``e*r .. e*r + r`` of A and, of B, the
  columns ``j*E + e`` (B viewed as [out, r, E]): PEFT's ``ParamWrapper.get_delta_weight``. The
  gate_up_proj pair is one A per expert and a B whose first I rows are the gate's, the next I the up's.
- Per expert, as PEFT wrote it for transformers 4 and as vLLM reads it:
  ``<block>.experts.<e>.{gate_proj,up_proj,down_proj}`` (Mixtral: ``w1``, ``w3``, ``w2``, its block
  ``block_sparse_moe``), each a plain pair A [r, in], B [out, r]; every expert of a projection must be there.

Refused with an error naming the adapter and the module: LoRA on the router (``<block>.gate``), an MoE
layer whose experts cannot take LoRA (quantized, expert- or tensor-parallel, GPT-OSS's interleaved
layout: ``targets["moe_refused"]``), shapes that fit neither projection, a layout mixed inside one block.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

PER_EXPERT = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}
_EXPERT_RE = re.compile(r"(.+)\.experts\.(\d+)\.([A-Za-z0-9_]+)")


@dataclass
class MoEPlan:
    """Where one MoE block's expert LoRA tensors are: stacked pairs by projection ("gate_up" / "down"),
    or per-expert pairs by projection ("gate", "up", "down") and expert."""

    stacked: dict[str, tuple[str, str, int, float]] = field(default_factory=dict)  # (key A, key B, rank, scale)
    experts: dict[str, dict[int, tuple[str, str, int, float]]] = field(default_factory=dict)


def _block_path(targets: dict[str, Any], block: str) -> str | None:
    """``block`` if it is an MoE module of the model (refused ones too), else None."""
    return block if block in targets.get("moe", {}) or block in targets.get("moe_refused", {}) else None


def moe_module_of(targets: dict[str, Any], ckpt_module: str) -> tuple[str, str, int | None] | None:
    """(our MoE module path, projection, expert) of a checkpoint module (renamed to this engine's names:
    Mixtral's ``block_sparse_moe`` is ``mlp``) that is LoRA on MoE experts or its router -- projection
    "stacked" (PEFT's 3-D layout), "gate"/"up"/"down" (per expert, with the expert) or "router" -- else None."""
    name = ckpt_module
    while name.endswith(".base_layer"):
        name = name[: -len(".base_layer")]
    if name.endswith(".experts"):
        path = _block_path(targets, name[: -len(".experts")])
        return None if path is None else (path, "stacked", None)
    m = _EXPERT_RE.fullmatch(ckpt_module)
    if m and m.group(3) in PER_EXPERT:
        path = _block_path(targets, m.group(1))
        return None if path is None else (path, PER_EXPERT[m.group(3)], int(m.group(2)))
    if ckpt_module.endswith(".gate"):
        path = _block_path(targets, ckpt_module[: -len(".gate")])
        return None if path is None else (path, "router", None)
    return None


def _rank(adapter_dir: Any, cfg: Any, name: str, max_rank: int | None) -> int:
    r = cfg.rank_of(name)
    if max_rank is not None and r > max_rank:
        raise ValueError(f"{adapter_dir}: {name}: LoRA rank {r} (rank_pattern) is greater than --max-lora-rank "
                         f"{max_rank}")
    return r


def plan_moe_tensors(adapter_dir: Any, cfg: Any, targets: dict[str, Any],
                     found: dict[str, tuple[tuple[str, str, int | None], dict[str, tuple[str, list[int]]]]],
                     max_rank: int | None = None) -> dict[str, MoEPlan]:
    """Check the expert LoRA tensors ``found`` (checkpoint module -> (``moe_module_of``'s answer, the pair's
    {"lora_A"/"lora_B": (key, shape)})) against the model; returns a plan per MoE module path. ``cfg``: the
    adapter's ``AdapterConfig`` (rank and scale per module or parameter name: PEFT's rank/alpha patterns)."""
    plans: dict[str, MoEPlan] = {}
    for ckpt_module, ((path, proj, expert), halves) in sorted(found.items()):
        if proj == "router":
            raise ValueError(f"{adapter_dir}: module {ckpt_module}: LoRA on the MoE router gate is not supported")
        if path in targets.get("moe_refused", {}):
            raise ValueError(f"{adapter_dir}: module {ckpt_module}: LoRA on these experts is not supported "
                             f"({targets['moe_refused'][path]})")
        e, h, i = targets["moe"][path]
        (key_a, a), (key_b, b) = halves["lora_A"], halves["lora_B"]
        plan = plans.setdefault(path, MoEPlan())
        if proj == "stacked":
            # PEFT names the parameter: <experts module>.gate_up_proj / .down_proj (rank patterns match it)
            experts_module = ckpt_module.split(".base_layer")[0]
            names = {"gate_up": f"{experts_module}.gate_up_proj", "down": f"{experts_module}.down_proj"}
            fits = {"gate_up": (h, 2 * i), "down": (i, h)}
            ranks = {p: cfg.rank_of(names[p]) for p in fits}
            which = next((p for p, (k, n) in fits.items()
                          if list(a) == [ranks[p] * e, k] and list(b) == [n, ranks[p] * e]), None)
            if which is None:
                rg, rd = ranks["gate_up"] * e, ranks["down"] * e
                raise ValueError(f"{adapter_dir}: {ckpt_module}: lora_A {list(a)} / lora_B {list(b)} fit neither "
                                 f"gate_up_proj ([{rg}, {h}] / [{2 * i}, {rg}]) nor down_proj ([{rd}, {i}] / [{h}, "
                                 f"{rd}]) at ranks {ranks['gate_up']} / {ranks['down']} with {e} experts")
            if which in plan.stacked:
                raise ValueError(f"{adapter_dir}: {ckpt_module}: a second LoRA pair for the experts' {which}_proj")
            r = _rank(adapter_dir, cfg, names[which], max_rank)
            plan.stacked[which] = (key_a, key_b, r, cfg.scaling_of(names[which]))
        else:
            k, n = (i, h) if proj == "down" else (h, i)
            r = _rank(adapter_dir, cfg, ckpt_module, max_rank)
            if expert >= e or list(a) != [r, k] or list(b) != [n, r]:
                raise ValueError(f"{adapter_dir}: {ckpt_module}: lora_A {list(a)} / lora_B {list(b)} do not fit "
                                 f"rank {r} and expert {expert} of {e} ({k} inputs / {n} outputs)")
            plan.experts.setdefault(proj, {})[expert] = (key_a, key_b, r, cfg.scaling_of(ckpt_module))
    for path, plan in plans.items():
        e = targets["moe"][path][0]
        if plan.stacked and plan.experts:
            raise ValueError(f"{adapter_dir}: MoE block {path}: stacked (PEFT target_parameters) and per-expert "
                             "LoRA tensors mixed")
        for proj, by_expert in plan.experts.items():
            missing = sorted(set(range(e)) - set(by_expert))
            if missing:
                raise ValueError(f"{adapter_dir}: MoE block {path}: {proj} LoRA of experts {missing[:8]} missing "
                                 f"(every expert of a projection must be there)")
            if len({v[2] for v in by_expert.values()}) > 1:
                raise ValueError(f"{adapter_dir}: MoE block {path}: {proj} LoRA ranks differ between experts")
    return plans


def _checked(adapter_dir: Any, key: str, t: torch.Tensor) -> torch.Tensor:
    t = t.to(torch.float32)
    if not torch.isfinite(t).all():
        raise ValueError(f"{adapter_dir}: {key} has non-finite values")
    return t


def read_moe_tensors(f: Any, adapter_dir: Any, plans: dict[str, MoEPlan], targets: dict[str, Any],
                     dtype: torch.dtype) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Per MoE module path, per projection ("gate", "up", "down"): (A [E, r, in], B * scale [E, out, r])
    as ``dtype``, read from the open safetensors file ``f`` along ``plans``."""
    out: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for path, plan in plans.items():
        e, _, i = targets["moe"][path]
        projs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        for which, (key_a, key_b, r, scaling) in plan.stacked.items():
            a = _checked(adapter_dir, key_a, f.get_tensor(key_a)).reshape(e, r, -1)
            b = _checked(adapter_dir, key_b, f.get_tensor(key_b)) * scaling
            b = b.reshape(b.shape[0], r, e).permute(2, 0, 1)  # [E, out, r]: column j*E + e is expert e's j
            if which == "gate_up":
                projs["gate"], projs["up"] = (a, b[:, :i]), (a, b[:, i:])
            else:
                projs["down"] = (a, b)
        for proj, by_expert in plan.experts.items():
            rows = [by_expert[x] for x in range(e)]
            projs[proj] = (torch.stack([_checked(adapter_dir, ka, f.get_tensor(ka)) for ka, _, _, _ in rows]),
                           torch.stack([_checked(adapter_dir, kb, f.get_tensor(kb)) * sc for _, kb, _, sc in rows]))
        out[path] = {p: (a.to(dtype).contiguous(), b.to(dtype).contiguous()) for p, (a, b) in projs.items()}
    return out
