"""The model side of fine-tuning: load a Hugging Face `transformers` model, patch our training
kernels into it (Liger-Kernel style), and compute the loss of a packed batch.

Training runs on the HF model, not on tokenfab's paged inference models: module paths stay HF's,
so PEFT-format adapters and merged folders come out with the names every tool expects.

``apply_kernels`` patches *instances* (each module's ``forward``), never the HF classes or module
globals, so a patched model and a plain one can live in the same process (the convergence test
trains both). Each kernel module is imported lazily; ops whose kernel is missing keep HF's code
and are left out of the list ``apply_kernels`` returns.
"""

from __future__ import annotations

import importlib
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100
# HF architectures whose decoder layer reads: norm -> attention -> +residual -> norm -> MLP -> +residual.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe")


def load_training_model(
    model: str | None = None, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
) -> tuple[nn.Module, Any]:
    """(hf_model, tokenizer) for ``model``: None (the bundled GGUF, dequantized by transformers),
    a ``.gguf`` file, or a Hugging Face folder (config.json + safetensors)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if model is None:
        from tokenfab.loader.bundled import bundled_model_path

        path = bundled_model_path()
    else:
        path = Path(model)
    if not path.exists():
        raise FileNotFoundError(f"model not found: {path}")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"model {path}: expected a .gguf file or a Hugging Face folder")
        kwargs: dict[str, Any] = {"gguf_file": path.name}
        folder = path.parent
    else:
        if not (path / "config.json").exists():
            raise ValueError(f"model folder {path} has no config.json")
        kwargs = {}
        folder = path
    hf_model = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, **kwargs)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), **kwargs)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return hf_model.to(device), tokenizer


def _optional(module: str, name: str) -> Callable | None:
    """``module.name`` if that kernel has landed, else None (the op keeps HF's code)."""
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return None


def _kernels() -> dict[str, Callable | None]:
    return {
        "rms_norm": _optional("tokenfab.kernels.norm_train", "rms_norm_train"),
        "rope": _optional("tokenfab.kernels.rope_train", "rope_train"),
        "silu_and_mul": _optional("tokenfab.kernels.activation_train", "silu_and_mul_train"),
        "gelu_and_mul": _optional("tokenfab.kernels.activation_train", "gelu_and_mul_train"),
        "flce": _optional("tokenfab.kernels.loss", "fused_linear_cross_entropy"),
        "moe_experts": _optional("tokenfab.kernels.moe_train", "moe_experts_train"),
    }


def _norm_forward(rms_norm: Callable) -> Callable:
    def forward(self, hidden_states: torch.Tensor, residual: torch.Tensor | None = None):
        return rms_norm(hidden_states, self.weight, self.variance_epsilon, residual=residual)

    return forward


def _decoder_layer_forward(self, hidden_states, attention_mask=None, position_ids=None, cache=None,
                           use_cache=False, position_embeddings=None, **kwargs):
    """HF's decoder layer with the second residual add fused into the post-attention RMSNorm."""
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states, attention_mask=attention_mask, position_ids=position_ids,
        cache=cache, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs,
    )
    hidden_states, residual = self.post_attention_layernorm(hidden_states, residual=residual)
    hidden_states = self.mlp(hidden_states)
    if isinstance(hidden_states, tuple):  # some MoE blocks return (hidden, router_logits)
        hidden_states = hidden_states[0]
    return residual + hidden_states


def _attention_forward(rope: Callable) -> Callable:
    """HF's Llama/Qwen2/Qwen3 attention (Qwen3's per-head q/k norms included) with our RoPE."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_proj(hidden_states).view(hidden_shape)
        k = self.k_proj(hidden_states).view(hidden_shape)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = rope(q.contiguous(), k.contiguous(), cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx, kwargs=kwargs)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, self._tf_eager)
        extra = {"sliding_window": self.sliding_window} if getattr(self, "sliding_window", None) else {}
        out, weights = attention(
            self, q, k, v, attention_mask, dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling, **extra, **kwargs,
        )
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights

    return forward


def _mlp_forward(act_and_mul: Callable) -> Callable:
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(act_and_mul(self.gate_proj(x), self.up_proj(x)))

    return forward


def _experts_forward(moe_experts: Callable, act: str) -> Callable:
    """HF's stacked experts (Qwen3-MoE layout: gate_up_proj [E, 2I, H], down_proj [E, H, I]) through the
    grouped-GEMM training kernel: sorted by expert, no per-expert Python loop."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj, self.down_proj, act)

    return forward


def _causal_lm_forward(flce: Callable | None) -> Callable:
    """The CausalLM's forward: given ``shift_labels`` it returns the summed loss from the final
    hidden states (FLCE against lm_head's weight: the [tokens, vocab] logits never exist in full);
    without them it is HF's forward (logits, generation)."""

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, shift_labels=None, **kwargs):
        if shift_labels is None:
            return type(self).forward(self, input_ids=input_ids, position_ids=position_ids,
                                      attention_mask=attention_mask, **kwargs)
        out = self.model(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                         use_cache=False, **kwargs)
        hidden = out.last_hidden_state
        hidden = hidden.reshape(-1, hidden.shape[-1])
        labels = shift_labels.reshape(-1)
        if flce is None:  # the loss kernel has not landed: plain logits + cross-entropy
            return _plain_loss_sum(self.lm_head(hidden), labels)
        return flce(hidden, self.lm_head.weight, labels, self.lm_head.bias, reduction="sum")

    return forward


def _act_kernel(config: Any, ops: dict[str, Callable | None]) -> tuple[str, Callable | None]:
    act = getattr(config, "hidden_act", "silu")
    if act in ("silu", "swish"):
        return "silu_and_mul", ops["silu_and_mul"]
    if act in ("gelu_pytorch_tanh", "gelu_new", "gelu_fast"):
        fn = ops["gelu_and_mul"]
        return "gelu_and_mul", (lambda g, u: fn(g, u, approximate="tanh")) if fn else None
    if act == "gelu":
        fn = ops["gelu_and_mul"]
        return "gelu_and_mul", (lambda g, u: fn(g, u, approximate="none")) if fn else None
    return act, None


def apply_kernels(hf_model: nn.Module) -> list[str]:
    """Patch our training kernels into ``hf_model`` (in place); returns the ops patched.

    RMSNorm (every instance; the post-attention one fused with the residual add), RoPE (in each
    attention), the MLP's act-and-mul, MoE experts (grouped GEMMs, Qwen3-MoE's SwiGLU experts), and
    the loss (FLCE from the final hidden states). The
    ``shift_labels`` forward (what ``packed_loss`` calls) is installed even when FLCE is missing.
    """
    config = hf_model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"apply_kernels: model type {config.model_type!r} is not supported "
            f"(supported: {', '.join(SUPPORTED_MODEL_TYPES)}); run with --no-kernels"
        )
    ops = _kernels()
    patched: set[str] = set()
    act_name, act_fn = _act_kernel(config, ops)
    for module in hf_model.modules():
        name = type(module).__name__
        if name.endswith("RMSNorm") and ops["rms_norm"] is not None:
            module.forward = types.MethodType(_norm_forward(ops["rms_norm"]), module)
            patched.add("rms_norm")
        elif name.endswith("DecoderLayer") and ops["rms_norm"] is not None:
            module.forward = types.MethodType(_decoder_layer_forward, module)
            patched.add("rms_norm+residual")
        elif name.endswith("Attention") and hasattr(module, "q_proj") and ops["rope"] is not None:
            from transformers.models.llama.modeling_llama import eager_attention_forward

            module._tf_eager = eager_attention_forward
            module.forward = types.MethodType(_attention_forward(ops["rope"]), module)
            patched.add("rope")
        elif name.endswith("Experts") and getattr(module, "gate_up_proj", None) is not None \
                and module.gate_up_proj.dim() == 3 and ops["moe_experts"] is not None and act_name == "silu_and_mul":
            module.forward = types.MethodType(_experts_forward(ops["moe_experts"], "silu"), module)
            patched.add("moe_experts")
        elif name.endswith("MLP") and hasattr(module, "gate_proj") and act_fn is not None:
            module.forward = types.MethodType(_mlp_forward(act_fn), module)
            patched.add(act_name)
    hf_model.forward = types.MethodType(_causal_lm_forward(ops["flce"]), hf_model)
    if ops["flce"] is not None:
        patched.add("fused_linear_cross_entropy")
    hf_model._tokenfab_kernels = sorted(patched)
    return sorted(patched)


def shift_labels_within_samples(labels: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Next-token labels of a packed row: position t learns labels[t+1], except each sample's last
    token (-100): a shift never crosses a sample boundary. ``labels`` [1, T] -> [1, T]."""
    shifted = torch.full_like(labels, IGNORE_INDEX)
    shifted[:, :-1] = labels[:, 1:]
    ends = cu_seqlens[1:].long() - 1
    shifted[:, ends] = IGNORE_INDEX
    return shifted


def _plain_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")


def packed_loss(model: nn.Module, batch: Any, kernels: bool) -> tuple[torch.Tensor, int]:
    """(summed token loss, number of loss tokens) of one ``PackedBatch``.

    Attention stays inside each sample through HF's packed-sequence path: no 2D attention mask and
    ``position_ids`` restarting at 0 per sample make ``create_causal_mask`` build a block-diagonal
    causal mask (checked by the test: a packed batch's loss equals its samples' losses run alone).
    HF does so only without a KV cache, hence ``use_cache=False`` on every call here.
    ``kernels``: the model was patched by ``apply_kernels`` (FLCE); else plain logits + CE in fp32.
    """
    shifted = shift_labels_within_samples(batch.labels, batch.cu_seqlens)
    num_tokens = int((shifted != IGNORE_INDEX).sum())  # host tensors: no device sync
    device = next(model.parameters()).device
    input_ids = batch.input_ids.to(device, non_blocking=True)
    position_ids = batch.position_ids.to(device, non_blocking=True)
    shifted = shifted.to(device, non_blocking=True)
    if kernels:
        if not hasattr(model, "_tokenfab_kernels"):
            raise RuntimeError("packed_loss(kernels=True) needs apply_kernels(model) first")
        loss = model(input_ids=input_ids, position_ids=position_ids, shift_labels=shifted)
    else:
        logits = model(input_ids=input_ids, position_ids=position_ids, use_cache=False).logits
        loss = _plain_loss_sum(logits, shifted)
    return loss, num_tokens
