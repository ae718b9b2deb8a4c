"""EAGLE-3 draft heads (Li et al. 2025) in their published format, ``LlamaForCausalLMEagle3``.

The head drafts from the target's own features. For a token at position t:

    g      = fc([h_a ; h_b ; h_c])            the target's residual stream entering layers a, b, c
                                              (default 2, L//2, L-3; vLLM's convention), 3H_t -> H
    x      = [input_layernorm(embed(token)) ; hidden_norm(g)]          2H: the attention input
    r      = g + attn(x)                      one Llama decoder layer whose q/k/v read 2H
    n      = g + attn(x) + mlp(post_attention_layernorm(r))            (pre-norm residual block)
    logits = lm_head(norm(n))                 over the draft vocabulary; draft id i is target id i + d2t[i]

For the next draft position the head feeds itself: its own pre-norm output n (already H wide, so
``fc`` is skipped) takes the place of g. The attention runs over the head's own paged KV cache
(``layers.attention.Attention``: a ``ModelRunner`` over the head binds it like any model's).

Checkpoint names (vLLM/SGLang's loaders read the same): ``fc.weight`` [H, 3H_t],
``midlayer.{input_layernorm,hidden_norm,post_attention_layernorm}.weight``,
``midlayer.self_attn.{q,k,v,o}_proj.weight`` (q/k/v: [*, 2H]), ``midlayer.mlp.{gate,up,down}_proj.weight``,
``norm.weight``, ``lm_head.weight`` [draft_vocab, H], ``d2t`` [draft_vocab] (int64 offsets), ``t2d``
(ignored), ``embed_tokens.weight`` (optional: the target's embedding otherwise). An optional
``model.`` prefix is accepted. Config: a Llama config plus ``draft_vocab_size``, optionally
``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``.

Engine wiring (a draft loop feeding ``spec.accept`` with ``draft_probs_in_target_vocab``) is not
done here: this module gives the head, its loader, and the target's feature taps.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenfab.forward_batch import ForwardBatch
from tokenfab.layers.embedding import LMHead, VocabEmbedding
from tokenfab.layers.linear import Linear, MergedLinear
from tokenfab.layers.norm import RMSNorm
from tokenfab.loader.errors import ModelLoadError
from tokenfab.models.llama import LlamaAttention, LlamaMLP

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
_PACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def aux_layer_ids(num_target_layers: int, config: Any = None) -> tuple[int, ...]:
    """Which target layers' inputs feed the head: the config's, else (2, L//2, L-3)."""
    eagle = getattr(config, "eagle_config", None) or {}
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    if ids:
        return tuple(int(i) for i in ids)
    n = num_target_layers
    return (2, n // 2, n - 3)


def target_forward_with_aux(target: nn.Module, batch: ForwardBatch,
                            layer_ids: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's forward (``CausalLM``: model.embed_tokens / layers / norm) that also returns
    [T, len(layer_ids) * H]: the residual stream entering each listed layer (layer i's input,
    i.e. hidden_states[i] of transformers' ``output_hidden_states``)."""
    m = target.model
    x, residual = m.embed_tokens.forward(batch.input_ids), None
    taps: dict[int, torch.Tensor] = {}
    for i, layer in enumerate(m.layers):
        if i in layer_ids:
            taps[i] = x.clone() if residual is None else x + residual
        x, residual = layer.forward(x, residual, batch)
    x, _ = m.norm.forward(x, residual)
    return x, torch.cat([taps[i] for i in layer_ids], dim=-1)


class Eagle3DecoderLayer(nn.Module):
    """The Llama block whose attention reads [norm(embedding) ; norm(feature)] (2H)."""

    def __init__(self, config: Any, max_position: int) -> None:
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, 0, max_position)
        # the only change to a Llama attention: q/k/v project from 2H
        old = self.self_attn.qkv_proj
        self.self_attn.qkv_proj = MergedLinear(2 * h, old.shard_sizes, bias=old.bias is not None)
        self.mlp = LlamaMLP(config)

    def forward(self, embeds: torch.Tensor, feature: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """Returns the block's output plus its residual: the head's pre-norm hidden state."""
        residual = feature.clone()  # add_rms_norm accumulates into it in place
        x = torch.cat([self.input_layernorm.forward(embeds), self.hidden_norm.forward(feature)], dim=-1)
        x = self.self_attn.forward(x, batch)
        x, residual = self.post_attention_layernorm.forward(x, residual)
        return residual + self.mlp.forward(x)


class Eagle3Head(nn.Module):
    def __init__(self, config: Any, max_position: int | None = None) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.target_hidden_size = getattr(config, "target_hidden_size", None) or h
        self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
        max_position = max_position or config.max_position_embeddings
        self.fc = Linear(3 * self.target_hidden_size, h)
        self.embed_tokens = VocabEmbedding(config.vocab_size, h)
        self.midlayer = Eagle3DecoderLayer(config, max_position)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = LMHead(self.draft_vocab_size, h)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))

    def forward(self, input_ids: torch.Tensor, features: torch.Tensor,
                batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids [T] (the token at each position), features [T, 3H_t] (the target's taps) or
        [T, H] (the head's own previous output) -> (normed hidden for the logits, pre-norm hidden
        that feeds the next draft position), both [T, H]."""
        if features.shape[-1] != self.config.hidden_size:
            features = self.fc.forward(features)
        n = self.midlayer.forward(self.embed_tokens.forward(input_ids), features, batch)
        return self.norm.forward(n), n

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, draft_vocab] float32 logits."""
        return self.lm_head.forward(hidden)

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def draft_probs_in_target_vocab(self, probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[T, draft_vocab] -> [T, vocab_size] (zero outside the draft vocabulary): q for ``accept_tokens``."""
        out = probs.new_zeros(probs.shape[0], vocab_size)
        idx = self.to_target_ids(torch.arange(self.draft_vocab_size, device=probs.device))
        return out.index_copy_(1, idx, probs)


def _config(path: Path) -> Any:
    from transformers import LlamaConfig

    try:
        raw = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ModelLoadError(path, f"cannot read config.json ({e})") from None
    archs = raw.get("architectures") or []
    if not any(a in ARCHITECTURES for a in archs):
        raise ModelLoadError(path, f"architectures {archs} is not one of {ARCHITECTURES}")
    return LlamaConfig(**{k: v for k, v in raw.items() if k not in ("architectures", "model_type")})


def load_eagle3(path: str | Path, target: nn.Module | None = None, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu", max_position: int | None = None) -> Eagle3Head:
    """An ``Eagle3Head`` from a directory (config.json + *.safetensors). Without ``embed_tokens``
    in the checkpoint the head shares ``target``'s embedding (then required)."""
    from safetensors import safe_open

    path = Path(path)
    head = Eagle3Head(_config(path), max_position)
    params = dict(head.named_parameters()) | {"d2t": head.d2t}  # (the RoPE cache is computed)
    owner = {name: head.get_submodule(name.rsplit(".", 1)[0]) if "." in name else head for name in params}
    # what must be loaded: (parameter, shard) with shard None for unmerged parameters
    missing = {(n, i) for n in params
               for i in (range(len(owner[n].shard_sizes)) if isinstance(owner[n], MergedLinear) else [None])}
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(path, "no *.safetensors file")
    with torch.no_grad():
        for f in files:
            with safe_open(str(f), framework="pt") as st:
                for name in st.keys():
                    key = name.removeprefix("model.")
                    if key == "t2d":
                        continue
                    parts = key.split(".")
                    shard = None
                    if len(parts) >= 2 and parts[-2] in _PACKED:
                        merged, shard = _PACKED[parts[-2]]
                        key = ".".join(parts[:-2] + [merged, parts[-1]])
                    if key not in params:
                        raise ModelLoadError(path, f"unexpected tensor {name!r}")
                    dst = params[key]
                    if shard is not None:
                        lo, hi = owner[key].shard_range(shard)
                        dst = dst[lo:hi]
                    tensor = st.get_tensor(name)
                    if tuple(dst.shape) != tuple(tensor.shape):
                        raise ModelLoadError(path, f"{name!r} has shape {tuple(tensor.shape)}, "
                                             f"expected {tuple(dst.shape)}")
                    dst.copy_(tensor)
                    missing.discard((key, shard))
    if ("embed_tokens.weight", None) in missing:
        if target is None:
            raise ModelLoadError(path, "no embed_tokens in the checkpoint; pass the target model")
        head.embed_tokens.weight = target.model.embed_tokens.weight
        missing.discard(("embed_tokens.weight", None))
    if missing:
        raise ModelLoadError(path, f"missing tensors {sorted(n for n, _ in missing)}")
    return head.to(device=device, dtype=dtype)  # d2t stays int64 (only floating tensors are cast)
