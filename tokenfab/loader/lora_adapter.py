"""PEFT LoRA adapters read for serving: ``adapter_config.json`` + ``adapter_model.safetensors``.

An adapter's tensors ``base_model.model.<module path>.lora_A.weight`` [r, in] and ``.lora_B.weight``
[out, r] are mapped onto this engine's modules: q/k/v and gate/up land on shards of the merged
``qkv_proj`` / ``gate_up_proj`` (the model's ``packed_modules``), each shard with its own A and B,
so the delta of shard i is added to that shard's output rows only. The scale (alpha / r, or
alpha / sqrt(r) with rsLoRA) is folded into B once at load.

Nothing is dropped silently: a tensor whose module this model lacks, a shape that does not fit, a
missing half of a pair, an unsupported option (DoRA, rank or alpha patterns, bias, embeddings) or a
rank above ``max_rank`` is a ``ValueError`` naming it. Only safetensors are read (never pickle).
LoRA on MoE experts (PEFT's ``target_parameters`` layout, or per expert) is ``lora_moe``'s.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from tokenfab.loader.lora_moe import MoEPlan, moe_module_of, plan_moe_tensors, read_moe_tensors

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
PREFIX = "base_model.model."
MAX_CONFIG_BYTES = 1 << 20
#: checkpoint module names of older layouts -> this engine's; a model takes those its own
#: ``remap_checkpoint_name`` makes (Mixtral's transformers-4 block, Qwen2-MoE's shared expert)
CHECKPOINT_RENAMES = ((".block_sparse_moe.", ".mlp."), (".mlp.shared_expert.", ".mlp.shared_experts."))


@dataclass
class AdapterConfig:
    rank: int
    alpha: float
    use_rslora: bool
    target_modules: Any
    base_model_name: str | None
    #: PEFT's per-module rank and alpha: pattern -> value, the first pattern matching the end of a module's
    #: (or a targeted parameter's) name at a dot wins (``peft.utils.other.get_pattern_key``)
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)

    @property
    def scaling(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.use_rslora else self.rank)

    def rank_of(self, name: str) -> int:
        """The rank of the module or parameter ``name`` (the model's name, without ``base_model.model.``)."""
        return _pattern_value(self.rank_pattern, name, self.rank)

    def scaling_of(self, name: str) -> float:
        r, alpha = self.rank_of(name), _pattern_value(self.alpha_pattern, name, self.alpha)
        return alpha / (math.sqrt(r) if self.use_rslora else r)


def _pattern_value(patterns: dict[str, Any], name: str, default: Any) -> Any:
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


@dataclass
class LoRAWeights:
    """One adapter on the host: per target module (our module path), per shard, (A [r, in], B*scale [out, r]);
    per MoE module, per projection ("gate", "up", "down"), (A [E, r, in], B*scale [E, out, r])."""

    config: AdapterConfig
    path: str
    modules: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    moe: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)

    @property
    def rank(self) -> int:
        return self.config.rank

    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for shards in (*self.modules.values(), *self.moe.values())
                   for a, b in shards.values())


def read_adapter_config(adapter_dir: str | Path, max_rank: int | None = None) -> AdapterConfig:
    """The adapter's settings, checked (ValueError / FileNotFoundError naming the problem)."""
    d = Path(adapter_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"{adapter_dir}: not a directory")
    path = d / CONFIG_NAME
    if not path.is_file():
        raise FileNotFoundError(f"{adapter_dir}: no {CONFIG_NAME}")
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise ValueError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        cfg = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path}: not a JSON object")
    if cfg.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type is {cfg.get('peft_type')!r}, only LORA is supported")
    for key in ("use_dora", "modules_to_save", "layers_to_transform"):
        if cfg.get(key):
            raise ValueError(f"{path}: '{key}' is not supported")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{path}: bias {cfg['bias']!r} is not supported (only 'none')")
    if cfg.get("fan_in_fan_out"):
        raise ValueError(f"{path}: fan_in_fan_out is not supported")
    r, alpha = cfg.get("r"), cfg.get("lora_alpha", cfg.get("r"))
    if isinstance(r, bool) or not isinstance(r, int) or r < 1:
        raise ValueError(f"{path}: r must be a positive integer, got {r!r}")
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not math.isfinite(alpha):
        raise ValueError(f"{path}: lora_alpha must be a number, got {alpha!r}")
    if max_rank is not None and r > max_rank:
        raise ValueError(f"{adapter_dir}: LoRA rank {r} is greater than --max-lora-rank {max_rank}")
    patterns = {}
    for key, kind in (("rank_pattern", int), ("alpha_pattern", (int, float))):
        pattern = cfg.get(key) or {}
        if not isinstance(pattern, dict) or not all(
                isinstance(k, str) and isinstance(v, kind) and not isinstance(v, bool) and v > 0
                and math.isfinite(v) for k, v in pattern.items()):
            raise ValueError(f"{path}: {key} must map module patterns to positive numbers, got {pattern!r}")
        try:
            for k in pattern:
                re.compile(k)
        except re.error as e:
            raise ValueError(f"{path}: {key}: bad pattern ({e})") from None
        patterns[key] = pattern
    base = cfg.get("base_model_name_or_path")
    return AdapterConfig(r, float(alpha), bool(cfg.get("use_rslora", False)), cfg.get("target_modules"),
                         base if isinstance(base, str) else None, patterns["rank_pattern"],
                         {k: float(v) for k, v in patterns["alpha_pattern"].items()})


def shard_sizes_of(model: nn.Module, module_path: str) -> list[int]:
    """The output rows of each shard of a (possibly merged) projection of ``model``."""
    module = model.get_submodule(module_path)
    sizes = getattr(module, "shard_sizes", None)
    if sizes is None:  # a swapped-in quantized layer: the merged layout comes from its parent
        parent = model.get_submodule(module_path.rpartition(".")[0])
        leaf = module_path.rpartition(".")[2]
        if leaf == "qkv_proj" and getattr(parent, "splits", None):
            sizes = parent.splits
        elif leaf == "gate_up_proj":
            sizes = [module.out_features // 2] * 2
        else:
            sizes = [module.out_features]
    return [int(s) for s in sizes]


def lora_targets_of(model: nn.Module, supported: tuple[str, ...]) -> dict[str, Any]:
    """What adapters may target in ``model``, as plain data (it crosses the engine-core process boundary,
    so an API server can check an adapter's files before any request uses it): ``packed``, checkpoint
    leaf name -> [merged leaf, shard]; ``modules``, our module path -> [in_features, shard output sizes];
    ``renames``, [checkpoint name part, ours] (``CHECKPOINT_RENAMES`` that the model's loader applies)."""
    modules = {path: [int(m.in_features), shard_sizes_of(model, path)] for path, m in model.named_modules()
               if path.rpartition(".")[2] in supported and hasattr(m, "in_features")}
    packed = {k: list(v) for k, v in getattr(model, "packed_modules", {}).items()}
    remap = getattr(model, "remap_checkpoint_name", None)
    renames = [[old, new] for old, new in CHECKPOINT_RENAMES
               if remap is not None and remap(f"model{old}weight") == f"model{new}weight"]
    return {"packed": packed, "modules": modules, "renames": renames}


def _renamed(targets: dict[str, Any], checkpoint_module: str) -> str:
    name = f".{checkpoint_module}."
    for old, new in targets.get("renames", ()):
        name = name.replace(old, new)
    return name[1:-1]


def _target_of(targets: dict[str, Any], checkpoint_module: str) -> tuple[str, int]:
    """(our module path, shard index) of a checkpoint module path."""
    parent, _, leaf = checkpoint_module.rpartition(".")
    if leaf in targets["packed"]:
        merged, shard = targets["packed"][leaf]
        return f"{parent}.{merged}", int(shard)
    return checkpoint_module, 0


def check_adapter_files(adapter_dir: str | Path, targets: dict[str, Any], max_rank: int | None = None
                        ) -> tuple[AdapterConfig, dict[str, tuple[str, int, str, str]], dict[str, MoEPlan]]:
    """Check an adapter's config and its tensors' names and shapes (the safetensors header only) against
    ``targets`` (``lora_targets_of``, with the MoE modules' ``moe``/``moe_refused`` entries); returns the
    config, per checkpoint module (our path, shard, the A tensor's key, the B tensor's key), and the MoE
    experts' tensors per MoE module (``lora_moe.plan_moe_tensors``)."""
    cfg = read_adapter_config(adapter_dir, max_rank)
    weights_path = Path(adapter_dir) / WEIGHTS_NAME
    if not weights_path.is_file():
        if (Path(adapter_dir) / "adapter_model.bin").is_file():
            raise ValueError(f"{adapter_dir}: only {WEIGHTS_NAME} is read (adapter_model.bin is a pickle)")
        raise FileNotFoundError(f"{adapter_dir}: no {WEIGHTS_NAME}")
    shapes: dict[str, dict[str, tuple[str, list[int]]]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                name = key.removeprefix(PREFIX)
                for half in ("lora_A", "lora_B"):
                    if name.endswith(f".{half}.weight"):
                        shapes.setdefault(name[: -len(f".{half}.weight")], {})[half] = (key,
                                                                                         f.get_slice(key).get_shape())
                        break
                else:
                    raise ValueError(f"{adapter_dir}: tensor {key!r} is not a LoRA A/B weight (not supported)")
    except (OSError, RuntimeError, SafetensorError) as e:  # a bad header or file
        raise ValueError(f"{weights_path}: cannot read ({e})") from None
    if not shapes:
        raise ValueError(f"{adapter_dir}: the adapter has no LoRA tensors")
    where: dict[str, tuple[str, int, str, str]] = {}
    moe_found: dict[str, Any] = {}
    supported = sorted({p.rpartition(".")[2] for p in targets["modules"]}
                       | ({"experts"} if targets.get("moe") else set()))
    for ckpt_module, halves in sorted(shapes.items()):
        if set(halves) != {"lora_A", "lora_B"}:
            raise ValueError(f"{adapter_dir}: {ckpt_module} has {sorted(halves)} only (needs lora_A and lora_B)")
        ours = _renamed(targets, ckpt_module)  # rank patterns and messages keep the checkpoint's name
        moe_module = moe_module_of(targets, ours)
        if moe_module is not None:
            moe_found[ckpt_module] = (moe_module, halves)
            continue
        target, shard = _target_of(targets, ours)
        if target not in targets["modules"]:
            raise ValueError(f"{adapter_dir}: module {ckpt_module} is not a LoRA target this model supports "
                             f"({', '.join(supported)})")
        k, sizes = targets["modules"][target]
        (key_a, a), (key_b, b) = halves["lora_A"], halves["lora_B"]
        a, b = list(a), list(b)
        r = check_module_rank(adapter_dir, cfg, ckpt_module, max_rank)
        if shard >= len(sizes) or a != [r, k] or b != [sizes[shard], r]:
            raise ValueError(f"{adapter_dir}: {ckpt_module}: lora_A {a} / lora_B {b} do not fit rank {r} "
                             f"and the module's {k} inputs / {sizes[shard] if shard < len(sizes) else '?'} outputs")
        where[ckpt_module] = (target, shard, key_a, key_b)
    return cfg, where, plan_moe_tensors(adapter_dir, cfg, targets, moe_found, max_rank)


def check_module_rank(adapter_dir: str | Path, cfg: AdapterConfig, name: str, max_rank: int | None) -> int:
    """The rank of module or parameter ``name`` (``rank_pattern`` applied), checked against ``max_rank``."""
    r = cfg.rank_of(name)
    if max_rank is not None and r > max_rank:
        raise ValueError(f"{adapter_dir}: {name}: LoRA rank {r} (rank_pattern) is greater than --max-lora-rank "
                         f"{max_rank}")
    return r


@torch.no_grad()
def load_lora_weights(adapter_dir: str | Path, targets: dict[str, Any], dtype: torch.dtype,
                      max_rank: int | None = None) -> LoRAWeights:
    """Read one adapter, checked against ``targets`` (``lora_targets_of``), into host memory as ``dtype``."""
    cfg, where, moe_plans = check_adapter_files(adapter_dir, targets, max_rank)
    out = LoRAWeights(cfg, str(adapter_dir))
    try:
        with safe_open(str(Path(adapter_dir) / WEIGHTS_NAME), framework="pt") as f:
            for ckpt_module, (target, shard, key_a, key_b) in where.items():
                a, b = f.get_tensor(key_a).to(torch.float32), f.get_tensor(key_b).to(torch.float32)
                if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                    raise ValueError(f"{adapter_dir}: {ckpt_module} has non-finite values")
                scaling = cfg.scaling_of(ckpt_module)
                out.modules.setdefault(target, {})[shard] = (a.to(dtype).contiguous(),
                                                             (b * scaling).to(dtype).contiguous())
            out.moe = read_moe_tensors(f, adapter_dir, moe_plans, targets, dtype)
    except (OSError, RuntimeError, SafetensorError) as e:
        raise ValueError(f"{adapter_dir}: cannot read ({e})") from None
    return out
