"""The shapes ``tokenfab plan`` computes with: every weight tensor of a model with its size and how
tensor/expert parallelism shards it, the attention's per-token cache, and typed reads of ``config.json``
keys. ``model_spec`` fills them from a config (the per-family inventories in ``model_layers``).

Sharding kinds (what one of ``tp`` tensor-parallel ranks holds):
  ``col``  rows / tp (column-parallel weight or its bias)   ``row``  cols / tp (row-parallel weight)
  ``kv``   column-parallel over KV heads, one head per rank when tp > KV heads (replicated)
  ``head`` a per-head vector (attention sinks), / tp         ``rep``  replicated (norms, routers, MLA down-projections)
  ``vocab`` vocabulary rows padded to a multiple of 64 per rank (embedding, LM head)
  ``ecol``/``erow``/``erep`` stacked routed experts: EP shards the expert axis, else TP shards each
  expert's intermediate dim (``erep``: a per-expert vector over the hidden dim, not TP-sharded)
"""

from __future__ import annotations

from dataclasses import dataclass, field
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


class ConfigReader:
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
