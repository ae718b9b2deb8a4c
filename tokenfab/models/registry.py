"""From a Hugging Face `architectures` name to the model class that implements it."""

from __future__ import annotations

import importlib

_MODELS: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("tokenfab.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("tokenfab.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("tokenfab.models.llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("tokenfab.models.llama", "LlamaForCausalLM"),
    "MixtralForCausalLM": ("tokenfab.models.mixtral", "MixtralForCausalLM"),
    "Qwen2MoeForCausalLM": ("tokenfab.models.qwen3_moe", "Qwen2MoeForCausalLM"),
    "Qwen3MoeForCausalLM": ("tokenfab.models.qwen3_moe", "Qwen3MoeForCausalLM"),
    "GptOssForCausalLM": ("tokenfab.models.gpt_oss", "GptOssForCausalLM"),
    "DeepseekV3ForCausalLM": ("tokenfab.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    # Kimi K2.5 (multimodal wrapper around a DeepSeek-V3 text model): the text part only
    "KimiK25ForConditionalGeneration": ("tokenfab.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    "Kimi_K25ForConditionalGeneration": ("tokenfab.models.deepseek_v3", "DeepseekV3ForCausalLM"),
    # Qwen3-Next / Qwen3.5: Gated DeltaNet + gated attention hybrids (the VL wrappers: the text part only)
    "Qwen3NextForCausalLM": ("tokenfab.models.qwen3_next", "Qwen3NextForCausalLM"),
    "Qwen3_5ForCausalLM": ("tokenfab.models.qwen3_5", "Qwen3_5ForCausalLM"),
    "Qwen3_5MoeForCausalLM": ("tokenfab.models.qwen3_5", "Qwen3_5MoeForCausalLM"),
    "Qwen3_5ForConditionalGeneration": ("tokenfab.models.qwen3_5", "Qwen3_5ForConditionalGeneration"),
    "Qwen3_5MoeForConditionalGeneration": ("tokenfab.models.qwen3_5", "Qwen3_5MoeForConditionalGeneration"),
    "DeepseekV32ForCausalLM": ("tokenfab.models.deepseek_v32", "DeepseekV32ForCausalLM"),
    "GlmMoeDsaForCausalLM": ("tokenfab.models.deepseek_v32", "GlmMoeDsaForCausalLM"),
    "DeepseekV4ForCausalLM": ("tokenfab.models.deepseek_v4", "DeepseekV4ForCausalLM"),
}


def register_model(architecture: str, module: str, class_name: str) -> None:
    _MODELS[architecture] = (module, class_name)


def supported_architectures() -> list[str]:
    return sorted(_MODELS)


def resolve_model_class(architecture: str) -> type:
    """The class for an architecture name; KeyError with the supported list otherwise."""
    if architecture not in _MODELS:
        raise KeyError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(supported_architectures())}"
        )
    module, name = _MODELS[architecture]
    return getattr(importlib.import_module(module), name)
