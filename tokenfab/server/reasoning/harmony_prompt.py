"""GPT-OSS prompts rendered by `openai-harmony` from OpenAI chat messages (the prompt side of `gpt_oss.py`).

The mapping follows OpenAI's Harmony guide: the Harmony *system* message carries the reasoning effort
(``reasoning_effort``: low/medium/high; the model's default is medium) and the channel list; the OpenAI
``system``/``developer`` messages become the Harmony *developer* message's instructions, together with the
function tools; an assistant turn becomes an ``analysis`` message (its ``reasoning_content``/``reasoning``),
a ``final`` message (its content) and one ``commentary`` message ``to=functions.NAME`` per tool call; a
``tool`` message becomes a message from ``functions.NAME`` (found through its ``tool_call_id``) to the
assistant. Harmony itself drops the analysis of turns that ended in a final answer, as the model was
trained. Bad input raises `ValueError` with a message fit for a 400.
"""

from __future__ import annotations

import json
from typing import Any

from tokenfab.server.reasoning.harmony_vocab import harmony_encoding

_EFFORTS = ("low", "medium", "high")


def _text(content: Any, where: str) -> str:
    """Message content as text: a string, or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                raise ValueError(f"{where}: only text content parts are supported for GPT-OSS")
            parts.append(part["text"])
        return "".join(parts)
    raise ValueError(f"{where}: content must be a string or a list of text parts")


def _tool_description(tool: dict[str, Any]):
    from openai_harmony import ToolDescription

    fn = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(fn, dict) or tool.get("type") != "function" or not isinstance(fn.get("name"), str):
        raise ValueError("tools: each tool must be {'type': 'function', 'function': {'name': ...}}")
    return ToolDescription.new(fn["name"], fn.get("description") or "", parameters=fn.get("parameters"))


def render_gpt_oss_prompt(
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None = None,
    reasoning_effort: str | None = None,
) -> list[int]:
    """Token ids of the prompt, ending with ``<|start|>assistant`` (the model writes the channel next)."""
    from openai_harmony import (
        Author,
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
    )

    system = SystemContent.new()
    if reasoning_effort is not None:
        if reasoning_effort not in _EFFORTS:
            raise ValueError(f"reasoning_effort must be one of {', '.join(_EFFORTS)}")
        system = system.with_reasoning_effort(ReasoningEffort(reasoning_effort.capitalize()))
    instructions = [
        _text(m.get("content"), f"messages[{i}]")
        for i, m in enumerate(messages)
        if m.get("role") in ("system", "developer")
    ]
    out = [Message.from_role_and_content(Role.SYSTEM, system)]
    if instructions or tools:
        dev = DeveloperContent.new()
        if instructions:
            dev = dev.with_instructions("\n\n".join(instructions))
        if tools:
            dev = dev.with_function_tools([_tool_description(t) for t in tools])
        out.append(Message.from_role_and_content(Role.DEVELOPER, dev))
    call_names: dict[str, str] = {}  # tool_call_id -> function name
    for i, m in enumerate(messages):
        role, where = m.get("role"), f"messages[{i}]"
        if role in ("system", "developer"):
            continue
        if role == "user":
            out.append(Message.from_role_and_content(Role.USER, _text(m.get("content"), where)))
        elif role == "assistant":
            reasoning = m.get("reasoning_content") or m.get("reasoning")
            if reasoning:
                out.append(Message.from_role_and_content(Role.ASSISTANT, str(reasoning)).with_channel("analysis"))
            text = _text(m.get("content"), where)
            calls = m.get("tool_calls") or []
            if text:
                # Text next to tool calls was a preamble (commentary); alone it was the final answer.
                out.append(
                    Message.from_role_and_content(Role.ASSISTANT, text).with_channel("commentary" if calls else "final")
                )
            for j, call in enumerate(calls):
                fn = call.get("function") if isinstance(call, dict) else None
                if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                    raise ValueError(f"{where}.tool_calls[{j}]: a function call needs a name")
                args = fn.get("arguments") or "{}"
                args = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
                if call.get("id"):
                    call_names[call["id"]] = fn["name"]
                out.append(
                    Message.from_role_and_content(Role.ASSISTANT, args)
                    .with_channel("commentary")
                    .with_recipient(f"functions.{fn['name']}")
                    .with_content_type("<|constrain|>json")
                )
        elif role == "tool":
            call_id = m.get("tool_call_id")
            if call_id not in call_names:
                raise ValueError(f"{where}: tool_call_id {call_id!r} matches no earlier assistant tool call")
            author = Author.new(Role.TOOL, f"functions.{call_names[call_id]}")
            out.append(
                Message.from_author_and_content(author, _text(m.get("content"), where))
                .with_channel("commentary")
                .with_recipient("assistant")
            )
        else:
            raise ValueError(f"{where}: unknown role {role!r}")
    enc = harmony_encoding()
    return enc.render_conversation_for_completion(Conversation.from_messages(out), Role.ASSISTANT)


def gpt_oss_stop_token_ids() -> list[int]:
    """The tokens that end an assistant turn: ``<|return|>`` (final answer) and ``<|call|>`` (tool call)."""
    return list(harmony_encoding().stop_tokens_for_assistant_actions())
