"""A model's shape from its ``config.json`` alone (no weights, no transformers): every weight tensor with
its size and how tensor/expert parallelism shards it, and the per-token cache of its attention.

The tensor list mirrors the Hugging Face modules exactly (tests compare the counts with transformers'
models built on the meta device), one entry per tensor per layer, named as in the checkpoints so that
a quantization config's ignore lists can be applied to the names.

Sharding kinds (what one of ``tp`` tensor-parallel ranks holds):
  ``col``  rows / tp (column-parallel weight or its bias)   ``row``  cols / tp (row-parallel weight)
  ``kv``   column-parallel over KV heads, one head per rank when tp > KV heads (replicated)
  ``head`` a per-head vector (attention sinks), / tp         ``rep``  replicated (norms, routers, MLA down-projections)
  ``vocab`` vocabulary rows padded to a multiple of 64 per rank (embedding, LM head)
  ``ecol``/``erow``/``erep`` stacked routed experts: EP shards the expert axis, else TP shards each
  expert's intermediate dim (``erep``: a per-expert vector over the hidden dim, not TP-sharded)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenfab.planner.hardware import PlanInputError


@dataclass(frozen=True)
class Weight:
    name: str       # checkpoint module name (experts: expert 0's, e.g. ``...mlp.experts.0.gate_proj``)
    rows: int       # output features (per expert for stacked experts)
    cols: int       # input features (1 for a vector)
    kind: str       # sharding kind, see the module docstring
    linear: bool = True   # a GEMM weight: quantization may apply, costs 2 FLOPs per value per token
    experts: int = 1      # stacked routed experts (ecol/erow/erep)
    per_seq: bool = False  # LM head: runs once per sequence per step, not once per token
    quantizable: bool = True  # False: kept in the model dtype by every format (routers, LM head, norms)

    @property
    def numel(self) -> int:
        return self.rows * self.cols * self.experts


@dataclass(frozen=True)
class AttentionShape:
    kind: str                 # "gqa" | "mla" | "dsa"
    num_heads: int
    num_kv_heads: int         # GQA; 1 for MLA (one latent "head")
    head_dim: int             # GQA q/k/v head dim; MLA: qk_nope + qk_rope
    v_head_dim: int
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    index_head_dim: int = 0
    index_n_heads: int = 0
    index_topk: int = 0
    sliding_window: int = 0   # informational: tokenfab's cache holds the full context on sliding layers

    def cache_values_per_layer(self) -> int:
        """Values one token stores per layer in tokenfab's cache (all ranks together for GQA)."""
        if self.kind == "gqa":
            return 2 * self.num_kv_heads * self.head_dim
        # MLA: the normed latent and the shared rope key; DSA adds the indexer key (on every layer)
        return self.kv_lora_rank + self.qk_rope_head_dim + (self.index_head_dim if self.kind == "dsa" else 0)


@dataclass
class ModelSpec:
    model_type: str
    architecture: str
    hidden_size: int
    num_layers: int
    vocab_size: int
    attention: AttentionShape
    weights: list[Weight]
    num_experts: int = 0
    experts_per_token: int = 0
    moe_layers: int = 0
    mtp_params: int = 0   # multi-token-prediction layers in the checkpoint (kept off the GPU by tokenfab)
    dtype: str = "bfloat16"
    quantization_config: dict[str, Any] | None = None
    intermediate_sizes: list[int] = field(default_factory=list)  # TP divisibility checks

    @property
    def num_params(self) -> int:
        return sum(w.numel for w in self.weights)

    @property
    def active_params(self) -> int:
        """Parameters one token multiplies through (routed experts: top-k of E; embedding lookups excluded)."""
        total = 0.0
        for w in self.weights:
            if w.kind == "vocab" and not w.per_seq:
                continue
            total += w.numel * (self.experts_per_token / w.experts if w.experts > 1 else 1)
        return int(total)


SUPPORTED = ("llama", "mistral", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "gpt_oss",
             "deepseek_v3", "kimi_k2", "deepseek_v32", "glm_moe_dsa")


def load_config(model: str | Path) -> dict[str, Any]:
    """``config.json`` of a folder (or the file itself) as a dict; weights are not needed."""
    path = Path(model)
    if path.is_dir():
        path = path / "config.json"
    if not path.is_file():
        raise PlanInputError(f"{model}: no config.json (MODEL must be a folder holding one, or the file)")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanInputError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise PlanInputError(f"{path}: expected a JSON object")
    quant = path.parent / "hf_quant_config.json"  # ModelOpt's NVFP4/FP8 exports
    if "quantization_config" not in config and quant.is_file():
        try:
            q = json.loads(quant.read_text())
        except json.JSONDecodeError as e:
            raise PlanInputError(f"{quant}: not valid JSON ({e})") from None
        config["quantization_config"] = {"quant_method": "modelopt", **q.get("quantization", q)}
    return config


class _Cfg:
    """Typed reads of config keys with clear errors."""

    def __init__(self, d: dict[str, Any], where: str) -> None:
        self.d, self.where = d, where

    def int(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        v = self.d.get(key, default)
        if v is None:
            raise PlanInputError(f"config.json: missing {key!r} (needed for a {self.where} model)")
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise PlanInputError(f"config.json: {key!r} must be an integer >= {minimum}, got {v!r}")
        return v

    def opt_int(self, key: str) -> int | None:
        return None if self.d.get(key) is None else self.int(key)

    def flag(self, key: str, default: bool = False) -> bool:
        return bool(self.d.get(key, default))


def build_spec(config: dict[str, Any]) -> ModelSpec:
    """The weight inventory and attention shape of a config dict (a text model, or a multimodal
    wrapper's ``text_config`` such as Kimi K2.5's)."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    model_type = str(text.get("model_type") or config.get("model_type") or "")
    if model_type not in SUPPORTED:
        raise PlanInputError(f"config.json: model_type {model_type!r} is not supported by tokenfab plan; "
                             f"supported: {', '.join(SUPPORTED)}")
    c = _Cfg(text, model_type)
    arch = (config.get("architectures") or text.get("architectures") or [model_type])[0]
    from tokenfab.planner import model_layers

    spec = model_layers.build(model_type, c)
    spec.architecture = str(arch)
    dtype = text.get("torch_dtype") or text.get("dtype") or config.get("torch_dtype") or "bfloat16"
    spec.dtype = "bfloat16" if dtype == "float32" else str(dtype)  # serving never runs fp32 on a GPU
    q = config.get("quantization_config") or text.get("quantization_config")
    if q is not None and not isinstance(q, dict):
        raise PlanInputError("config.json: quantization_config must be an object")
    spec.quantization_config = q
    return spec
