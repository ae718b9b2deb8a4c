"""Text chat templates: OpenAI messages -> the prompt text under the model's (or a trusted request's) template.

GPT-OSS prompts are not rendered here but by openai-harmony, as token ids (``chat_harmony.py``).
"""

from __future__ import annotations

import json
from typing import Any

from tokenfab.server.errors import APIError
from tokenfab.server.protocol import ChatMessage


def template_messages(messages: list[ChatMessage], arguments_as_text: bool = False) -> list[dict[str, Any]]:
    """The conversation as chat templates expect it: assistant ``tool_calls`` with arguments as a dict (as
    Hugging Face templates read them) or, with `arguments_as_text`, as the JSON text the client sent (for
    templates that concatenate them as a string: DeepSeek-V3's and V3.1's ``'<｜tool▁sep｜>' +
    tool['function']['arguments']``), tool messages with ``tool_call_id``, an assistant turn's reasoning as
    ``reasoning_content`` (from that field or ``reasoning``)."""
    conv = []
    for m in messages:
        content = m.content
        if isinstance(content, list):
            content = "\n".join(part.text for part in content)
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
        if m.name:
            msg["name"] = m.name
        if m.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name,
                                               "arguments": c.function.arguments if arguments_as_text
                                               else json.loads(c.function.arguments)}}
                                 for c in m.tool_calls]
        if m.tool_call_id:
            msg["tool_call_id"] = m.tool_call_id
        reasoning = m.reasoning_content or m.reasoning
        if reasoning and m.role == "assistant":  # Qwen3's, GLM's, Kimi's templates render it for recent turns
            msg["reasoning_content"] = reasoning
        conv.append(msg)
    return conv


def render_chat(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool = True,
                continue_final_message: bool = False, kwargs: dict[str, Any] | None = None,
                chat_template: str | None = None) -> str:
    """The prompt text of ``messages`` under the model's chat template (or ``chat_template``, which
    the caller has checked is trusted). Runs in the server's tokenizer pool, off the event loop.

    Tool-call arguments go to the template as dicts (Hugging Face's convention); a template that fails on
    them (one that concatenates them as a string, as DeepSeek-V3's and V3.1's do) is tried again with the
    arguments as the JSON text the client sent."""
    if continue_final_message:
        add_generation_prompt = False
    extra = dict(kwargs or {})
    if chat_template is not None:
        extra["chat_template"] = chat_template
    has_calls = any(m.tool_calls for m in messages)
    error: Exception | None = None
    for as_text in (False, True) if has_calls else (False,):
        try:
            return tokenizer.apply_chat_template(
                template_messages(messages, arguments_as_text=as_text), tokenize=False,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message, **extra,
            )
        except Exception as e:  # jinja errors: role order, bad kwargs
            error = error or e
    raise APIError(400, f"could not apply the chat template: {error}", param="messages") from error
