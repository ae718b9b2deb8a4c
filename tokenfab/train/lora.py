"""LoRA on a Hugging Face model: ``LoRALinear`` wraps an ``nn.Linear`` (frozen) with a low-rank update
``y = base(x) + scale * B(A(dropout(x)))``, A ``[r, in]`` kaiming-uniform (as PEFT), B ``[out, r]`` zeros, so
training starts from the base model exactly. ``scale = alpha / r`` (``alpha / sqrt(r)`` with rsLoRA).

Module paths stay the model's own, and the low-rank factors are plain ``nn.Linear`` children named
``lora_A`` / ``lora_B``: a wrapped module's parameters are ``<path>.lora_A.weight`` / ``<path>.lora_B.weight``,
which is PEFT's saved naming once ``base_model.model.`` is put in front (see ``peft_io.py``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field

import torch
from torch import nn

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoRAConfig:
    r: int = 8
    alpha: float = 8.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    use_rslora: bool = False

    @property
    def scale(self) -> float:
        return self.alpha / math.sqrt(self.r) if self.use_rslora else self.alpha / self.r

    def to_dict(self) -> dict:
        return asdict(self)


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable low-rank update."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, dropout: float = 0.0, use_rslora: bool = False,
                 generator: torch.Generator | None = None) -> None:
        super().__init__()
        if r < 1:
            raise ValueError(f"LoRA rank must be at least 1, got {r}")
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {dropout}")
        self.base = base
        base.weight.requires_grad_(False)
        if base.bias is not None:
            base.bias.requires_grad_(False)
        kw = {"device": base.weight.device, "dtype": base.weight.dtype}
        self.lora_A = nn.Linear(base.in_features, r, bias=False, **kw)
        self.lora_B = nn.Linear(r, base.out_features, bias=False, **kw)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.r, self.alpha, self.use_rslora = r, alpha, use_rslora
        self.scale = alpha / math.sqrt(r) if use_rslora else alpha / r
        self.reset_parameters(generator)

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight(self) -> torch.Tensor:  # HF code sometimes reads `.weight` (dtype/device checks)
        return self.base.weight

    def reset_parameters(self, generator: torch.Generator | None = None) -> None:
        # PEFT's default: kaiming-uniform with a = sqrt(5) (nn.Linear's own init) for A, zeros for B.
        # The init runs on CPU so a seeded generator gives the same A on every device.
        a = torch.empty(self.lora_A.weight.shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
        with torch.no_grad():
            self.lora_A.weight.copy_(a)
            self.lora_B.weight.zero_()

    def delta_weight(self) -> torch.Tensor:
        """``scale * B @ A`` in float32: what merging adds to the base weight."""
        return (self.lora_B.weight.float() @ self.lora_A.weight.float()) * self.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(self.dropout(x))) * self.scale

    def extra_repr(self) -> str:
        return f"r={self.r}, alpha={self.alpha}, scale={self.scale:g}"


def _matches(name: str, targets: list[str] | str) -> bool:
    """PEFT's rule: a string is a regex over the full module name; a list matches the name or its suffix."""
    if isinstance(targets, str):
        return re.fullmatch(targets, name) is not None
    return name in targets or any(name.endswith("." + t) for t in targets)


def _output_embedding_names(model: nn.Module) -> set[str]:
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    return {n for n, m in model.named_modules() if head is not None and m is head}


def inject_lora(model: nn.Module, r: int = 8, alpha: float = 8.0, dropout: float = 0.0,
                target_modules: list[str] | str | None = None, use_rslora: bool = False,
                init_seed: int = 0) -> nn.Module:
    """Freeze ``model`` and wrap its matching ``nn.Linear`` modules in :class:`LoRALinear`, in place.

    ``target_modules``: a list of names or name suffixes (``["q_proj", "v_proj"]``), a regex over full module
    names, ``"all-linear"`` (every linear layer but the output head, as PEFT) or None (attention and MLP
    projections). A's are drawn from one generator seeded by ``init_seed``, in module order.
    """
    if any(isinstance(m, LoRALinear) for m in model.modules()):
        raise ValueError("the model already has LoRA layers")
    head = _output_embedding_names(model)
    targets = list(DEFAULT_TARGETS) if target_modules is None else target_modules
    chosen = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or name in head:
            continue
        if targets == "all-linear" or _matches(name, targets):
            chosen.append(name)
    if not chosen:
        raise ValueError(f"no nn.Linear module matches target_modules={targets!r}")
    for p in model.parameters():
        p.requires_grad_(False)
    gen = torch.Generator().manual_seed(init_seed)
    for name in chosen:
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, LoRALinear(getattr(parent, leaf), r, alpha, dropout, use_rslora, gen))
    leaves = sorted({n.rpartition(".")[2] for n in chosen})
    model.lora_config = LoRAConfig(r, alpha, dropout, leaves, use_rslora)
    return model


def lora_modules(model: nn.Module) -> Iterator[tuple[str, LoRALinear]]:
    for name, module in model.named_modules():
        if isinstance(module, LoRALinear):
            yield name, module


def lora_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{"<path>.lora_A.weight": A, "<path>.lora_B.weight": B}`` for every LoRA layer (the model's own names)."""
    out = {}
    for name, m in lora_modules(model):
        out[f"{name}.lora_A.weight"] = m.lora_A.weight
        out[f"{name}.lora_B.weight"] = m.lora_B.weight
    return out


@torch.no_grad()
def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every LoRA update into its base weight (in float32, then the weight's dtype) and put the plain
    ``nn.Linear`` back, in place: the result is the base architecture, with no trace of LoRA."""
    for name, m in list(lora_modules(model)):
        w = m.base.weight
        w.copy_((w.float() + m.delta_weight()).to(w.dtype))
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, m.base)
    if hasattr(model, "lora_config"):
        del model.lora_config
    return model
