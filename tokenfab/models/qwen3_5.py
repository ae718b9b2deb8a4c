"""Qwen3.5, dense and MoE: the Qwen3-Next hybrid decoder (``models/qwen3_next.py``: 3 Gated DeltaNet layers,
then 1 gated-attention layer, by ``layer_types``) with separate Gated DeltaNet projections
(``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a``).

    dense (``qwen3_5_text``, Qwen3_5ForCausalLM): a SwiGLU MLP of ``intermediate_size`` on every layer
    MoE (``qwen3_5_moe_text``, Qwen3_5MoeForCausalLM): on every layer, softmax top-k routed experts
          (always renormalised) + sigmoid(x Wg^T) * shared_expert(x)

Rotary embedding: the text config names multimodal RoPE (``mrope_section``, ``mrope_interleaved``); for text
the temporal, height and width positions are all the token's position, so each rotary frequency turns by
that position and M-RoPE is the plain (partial) RoPE, which is what we compute.

The published checkpoints are the vision-language wrappers (``qwen3_5`` / ``qwen3_5_moe``,
Qwen3_5ForConditionalGeneration / Qwen3_5MoeForConditionalGeneration): ``text_config`` holds the text model's
config and the weights sit under ``model.language_model.*`` beside the vision tower ``model.visual.*`` and
``lm_head.weight``; MoE experts stacked (``mlp.experts.gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I]).
We serve the text model: the vision tower is skipped at load (never materialised; a warning says so),
image inputs are refused by the request schema, and the MTP layer (``mtp.*``, top level) is kept aside for MTP
speculative decoding (``speculative/qwen_mtp.py``).
"""

from __future__ import annotations

import logging
from typing import Any

from tokenfab.layers.embedding import LMHead
from tokenfab.models.llama import LlamaMLP
from tokenfab.models.qwen3_next import HybridCausalLM, make_shared_expert_moe

logger = logging.getLogger(__name__)

_LANGUAGE_MODEL = "model.language_model."
_VISION = ("model.visual.", "visual.")


class _Qwen3_5Checkpoint:
    """Checkpoint names of the Qwen3.5 layouts: the text model under ``model.language_model.*`` (the
    wrapper's, also read by the text classes as transformers does), the vision tower skipped."""

    _warned_vision = False

    def remap_checkpoint_name(self, name: str) -> str | None:
        if name.startswith(_VISION):
            if not self._warned_vision:
                logger.warning("%s: the vision tower (model.visual.*) is not loaded; tokenfab serves this model "
                               "text only", type(self).__name__)
                self._warned_vision = True
            return None
        if name.startswith(_LANGUAGE_MODEL):
            name = "model." + name[len(_LANGUAGE_MODEL):]
        return super().remap_checkpoint_name(name)  # type: ignore[misc]


class Qwen3_5ForCausalLM(_Qwen3_5Checkpoint, HybridCausalLM):
    def __init__(self, config: Any, max_position: int | None = None) -> None:
        max_position = max_position or config.max_position_embeddings
        super().__init__(config, max_position, lambda i: LlamaMLP(config))


class Qwen3_5MoeForCausalLM(_Qwen3_5Checkpoint, HybridCausalLM):
    def __init__(self, config: Any, max_position: int | None = None) -> None:
        max_position = max_position or config.max_position_embeddings
        super().__init__(config, max_position, lambda i: make_shared_expert_moe(config, renormalize=True))


def _text_part(model: HybridCausalLM, wrapper: Any) -> None:
    """The wrapper's ``tie_word_embeddings`` (transformers ties by the top-level config) over the text
    config's; ``model.config`` stays the text config."""
    tie = bool(getattr(wrapper, "tie_word_embeddings", False))
    tied = model.lm_head.weight is model.model.embed_tokens.weight
    if tie and not tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    elif tied and not tie:
        emb = model.model.embed_tokens.weight
        model.lm_head = LMHead(model.config.vocab_size, model.config.hidden_size)
        model.lm_head.to(device=emb.device, dtype=emb.dtype)


class Qwen3_5ForConditionalGeneration(Qwen3_5ForCausalLM):
    """The vision-language wrapper, text only (module docstring)."""

    def __init__(self, config: Any, max_position: int | None = None) -> None:
        super().__init__(config.text_config, max_position)
        _text_part(self, config)


class Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeForCausalLM):
    """The vision-language MoE wrapper, text only (module docstring)."""

    def __init__(self, config: Any, max_position: int | None = None) -> None:
        super().__init__(config.text_config, max_position)
        _text_part(self, config)

