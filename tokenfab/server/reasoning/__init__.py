"""Reasoning parsers: split model output into `reasoning_content` and `content` (see `base.py`).

Names follow vLLM's ``--reasoning-parser``: ``deepseek_r1``, ``deepseek_v3``, ``qwen3``, ``glm45``,
``kimi_k2``, ``gpt_oss``. `reasoning_parser_for_model` picks one from a Hugging Face ``model_type``.
"""

from __future__ import annotations

from tokenfab.server.reasoning.base import CONTENT, REASONING, ReasoningParser, ReasoningStream, join_pieces
from tokenfab.server.reasoning.gpt_oss import GptOssReasoningParser
from tokenfab.server.reasoning.think_tags import DEEPSEEK_R1, DEEPSEEK_V3, GLM45, KIMI_K2, QWEN3, ThinkTagParser

_THINK_FAMILIES = {f.name: f for f in (DEEPSEEK_R1, DEEPSEEK_V3, QWEN3, GLM45, KIMI_K2)}
REASONING_PARSERS = (*_THINK_FAMILIES, "gpt_oss")

# Hugging Face model_type -> parser. DeepSeek-V3.x (and GigaChat3, same architecture) think only when asked
# (`thinking: true`), so their parser passes plain output through untouched.
_BY_MODEL_TYPE = {
    "deepseek_r1": "deepseek_r1",
    "deepseek_v3": "deepseek_v3",
    "deepseek_v32": "deepseek_v3",
    "qwen3": "qwen3",
    "qwen3_moe": "qwen3",
    "qwen3_next": "qwen3",
    "glm4_moe": "glm45",
    "glm_moe_dsa": "glm45",
    "kimi_k2": "kimi_k2",
    "kimi_k25": "kimi_k2",
    "gpt_oss": "gpt_oss",
}


def get_reasoning_parser(
    name: str, *, chat_template_kwargs: dict | None = None, prompt: str | None = None
) -> ReasoningParser:
    """A parser for one request. `prompt` (the rendered prompt text) lets think-tag parsers see whether the
    template opened or closed the think block; `chat_template_kwargs` carries ``enable_thinking``/``thinking``."""
    if name == "gpt_oss":
        return GptOssReasoningParser(chat_template_kwargs=chat_template_kwargs, prompt=prompt)
    if name not in _THINK_FAMILIES:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of {', '.join(REASONING_PARSERS)}")
    return ThinkTagParser(_THINK_FAMILIES[name], chat_template_kwargs=chat_template_kwargs, prompt=prompt)


def reasoning_parser_for_model(model_type: str | None, architectures: list[str] | None = None) -> str | None:
    """The parser name for a model (its config's ``model_type``), or None if it has no reasoning format."""
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    for arch in architectures or ():
        if arch.startswith("GptOss"):
            return "gpt_oss"
    return None


__all__ = [
    "CONTENT",
    "REASONING",
    "REASONING_PARSERS",
    "ReasoningParser",
    "ReasoningStream",
    "get_reasoning_parser",
    "join_pieces",
    "reasoning_parser_for_model",
]
