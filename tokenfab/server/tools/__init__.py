"""Tool-call parsers: split model output into `content` and OpenAI-shaped `tool_calls` (see `base.py`).

Names follow vLLM's ``--tool-call-parser``: ``hermes``, ``llama3_json``, ``deepseek_v3``, ``deepseek_v31``,
``kimi_k2``, ``glm45``, ``gigachat3`` (GPT-OSS goes through Harmony, elsewhere). `tool_parser_for_model` picks
one from a Hugging Face ``model_type``/``architectures`` and, where one model type covers several formats
(DeepSeek-V3 vs V3.1, GigaChat3 on the DeepSeek-V3 architecture), from the chat template's text.
"""

from __future__ import annotations

from tokenfab.server.tools.base import (
    ContentDelta,
    Delta,
    ExtractedToolCalls,
    ToolCall,
    ToolCallDelta,
    ToolCallStream,
    ToolParser,
    assemble,
)
from tokenfab.server.tools.deepseek_v3 import DeepSeekV3ToolParser
from tokenfab.server.tools.deepseek_v31 import DeepSeekV31ToolParser
from tokenfab.server.tools.gigachat3 import GigaChat3ToolParser
from tokenfab.server.tools.glm45 import Glm45ToolParser
from tokenfab.server.tools.gpt_oss import GptOssToolParser
from tokenfab.server.tools.hermes import HermesToolParser
from tokenfab.server.tools.kimi_k2 import KimiK2ToolParser
from tokenfab.server.tools.llama3_json import Llama3JsonToolParser

_PARSERS: dict[str, type[ToolParser]] = {
    p.name: p
    for p in (
        HermesToolParser,
        Llama3JsonToolParser,
        DeepSeekV3ToolParser,
        DeepSeekV31ToolParser,
        KimiK2ToolParser,
        Glm45ToolParser,
        GigaChat3ToolParser,
    )
}
TOOL_PARSERS = tuple(_PARSERS)

_BY_MODEL_TYPE = {
    "qwen2": "hermes",
    "qwen2_moe": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "qwen3_next": "hermes",
    "llama": "llama3_json",
    "kimi_k2": "kimi_k2",
    "kimi_k25": "kimi_k2",
    "glm4_moe": "glm45",
    "glm_moe_dsa": "glm45",
    "deepseek_v3": "deepseek_v31",
    "deepseek_v32": "deepseek_v31",
    "gpt_oss": "openai",  # Harmony, tools/gpt_oss.py (not in TOOL_PARSERS: it reads the raw completion)
}


def get_tool_parser(name: str, tools: list[dict] | None = None) -> ToolParser:
    """The parser registered under `name` (a ValueError naming the choices otherwise); `tools` is the request's
    OpenAI ``tools`` list (GLM reads the parameter types from it)."""
    if name == "openai":  # GPT-OSS: one Harmony pass gives reasoning, content and calls (duck-typed extract/stream)
        return GptOssToolParser()  # type: ignore[return-value]
    if name not in _PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; choose one of {', '.join(TOOL_PARSERS)}")
    return _PARSERS[name](tools)


def tool_parser_for_model(
    model_type: str | None, architectures: list[str] | None = None, chat_template: str | None = None
) -> str | None:
    """The parser name for a model, or None if it has no known tool-call format. The template decides between
    formats that share a model type: GigaChat3 and DeepSeek-V3 (``function<｜tool▁sep｜>``) vs V3.1."""
    template = chat_template or ""
    if "<|role_sep|>" in template or "<|function_call|>" in template:
        return "gigachat3"
    if model_type in ("deepseek_v3", "deepseek_v32") and "function<｜tool▁sep｜>" in template:
        return "deepseek_v3"
    if model_type in _BY_MODEL_TYPE:
        return _BY_MODEL_TYPE[model_type]
    for arch in architectures or ():
        if arch.startswith(("Qwen2", "Qwen3")):
            return "hermes"
        if arch.startswith("Glm4Moe"):
            return "glm45"
        if arch.startswith("DeepseekV3"):
            return "deepseek_v31"
    return None


__all__ = [
    "TOOL_PARSERS",
    "ContentDelta",
    "Delta",
    "ExtractedToolCalls",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallStream",
    "ToolParser",
    "assemble",
    "get_tool_parser",
    "tool_parser_for_model",
]
