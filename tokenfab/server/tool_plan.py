"""What a chat request asks of tools (`ToolPlan`), the request checks that build it (`plan_tools`), and the
check every returned call passes (`call_ok`).

``tool_choice`` is ``none`` (or no tools), ``auto`` (calls read out of the content by the family's parser),
``required`` or a named function (both enforced by grammar, ``chat_grammar.py``). The plan is the one object
the prompt, the grammar and the output shapers (``chat_tools.py``, ``chat_harmony.py``) read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import jsonschema

from tokenfab.server.errors import APIError
from tokenfab.server.protocol import ChatCompletionRequest

_EMPTY_OBJECT = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """What a request asks of tools: ``mode`` is none, auto, required or named."""

    mode: str
    tools: list[dict[str, Any]] = field(default_factory=list)  # OpenAI ``tools`` as plain dicts
    named: str | None = None
    parallel: bool = True

    @property
    def constrained(self) -> bool:
        return self.mode in ("required", "named")


def tool_parameters(tool: dict[str, Any]) -> dict[str, Any]:
    """A tool's ``parameters`` schema (an empty object schema when it has none)."""
    return tool["function"].get("parameters") or _EMPTY_OBJECT


def call_ok(plan: ToolPlan, name: str | None, arguments: str) -> bool:
    """True when ``name`` is one of the request's tools and ``arguments`` is a JSON object that validates
    against that tool's ``parameters`` schema (checked already by `plan_tools`)."""
    tool = next((t for t in plan.tools if t["function"]["name"] == name), None)
    if tool is None:
        return False
    try:
        args = json.loads(arguments)
    except ValueError:
        return False
    if not isinstance(args, dict):
        return False
    schema = tool_parameters(tool)
    return jsonschema.validators.validator_for(schema)(schema).is_valid(args)


def _check_tool_messages(body: ChatCompletionRequest) -> None:
    for i, m in enumerate(body.messages):
        if m.role == "tool" and not m.tool_call_id:
            raise APIError(400, f"messages[{i}]: a tool message needs tool_call_id (the id of the call it "
                           "answers)", param=f"messages.{i}.tool_call_id")
        if m.tool_calls is not None and m.role != "assistant":
            raise APIError(400, f"messages[{i}]: only assistant messages carry tool_calls",
                           param=f"messages.{i}.tool_calls")
        if m.tool_call_id is not None and m.role != "tool":
            raise APIError(400, f"messages[{i}]: tool_call_id belongs on a tool message",
                           param=f"messages.{i}.tool_call_id")
        for j, call in enumerate(m.tool_calls or ()):
            try:
                ok = isinstance(json.loads(call.function.arguments), dict)
            except ValueError:
                ok = False
            if not ok:
                raise APIError(400, f"messages[{i}].tool_calls[{j}].function.arguments is not a JSON object",
                               param=f"messages.{i}.tool_calls.{j}.function.arguments")


def _check_tools(tools: list[dict[str, Any]]) -> set[str]:
    """The tools' names; 400s for a name used twice or a ``parameters`` that is not an object schema."""
    names: set[str] = set()
    for i, t in enumerate(tools):
        name = t["function"]["name"]
        if name in names:
            raise APIError(400, f"tools[{i}]: the function name {name!r} is used twice",
                           param=f"tools.{i}.function.name")
        names.add(name)
        schema = t["function"].get("parameters")
        if schema is None:
            continue
        try:
            jsonschema.validators.validator_for(schema).check_schema(schema)
        except jsonschema.SchemaError as e:
            raise APIError(400, f"tools[{i}].function.parameters is not a valid JSON schema: {e.message}",
                           param=f"tools.{i}.function.parameters") from e
        if schema.get("type", "object") != "object":
            raise APIError(400, f"tools[{i}].function.parameters must describe an object (type: object)",
                           param=f"tools.{i}.function.parameters")
    return names


def plan_tools(body: ChatCompletionRequest) -> ToolPlan:
    """Validate tools, tool_choice and the tool messages (400s naming the field); return the plan."""
    _check_tool_messages(body)
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice != "none":
            raise APIError(400, "tool_choice needs tools: the request has none", param="tool_choice")
        return ToolPlan("none")
    tools = [t.model_dump(exclude_none=True) for t in body.tools]
    names = _check_tools(tools)
    if choice is None or isinstance(choice, str):
        return ToolPlan(choice or "auto", tools, parallel=body.parallel_tool_calls)
    if choice.function.name not in names:
        raise APIError(400, f"tool_choice names the function {choice.function.name!r}, which is not in tools "
                       f"({', '.join(sorted(names))})", param="tool_choice")
    return ToolPlan("named", tools, named=choice.function.name, parallel=body.parallel_tool_calls)
