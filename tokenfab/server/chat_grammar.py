"""Grammars for tool calls in /v1/chat/completions (xgrammar, compiled by ``engine/runner/structured.py``).

- ``tool_choice: "required"`` and a named function (`grammar_format`): the output is JSON, Llama-3's
  ``{"name": NAME, "parameters": {...}}`` (one object per tool, ``const`` names, an array of them when
  ``parallel_tool_calls``; "parameters", not "arguments", because the grammar compiler sorts keys and the name
  must come first to stream), or for a named function its arguments object alone. The call therefore always
  parses and matches its schema, even from a model never trained on tools.
- ``strict: true`` tools in auto mode (`strict_tag_format`), for the families whose call header is fixed text
  before a JSON object (`_CALL_TAGS`: hermes, llama3_json, deepseek_v3, deepseek_v31): an xgrammar structural
  tag lets text through until the family's call marker, then only a tool's header and arguments valid against
  its schema. Kimi K2 (the call index is in the header), GLM (arguments are not JSON), GigaChat3 and GPT-OSS
  get only the jsonschema check of `tool_plan.call_ok`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenfab.server.protocol import JsonSchemaFormat, ResponseFormat
from tokenfab.server.tool_plan import ToolPlan, tool_parameters


def grammar_format(plan: ToolPlan) -> ResponseFormat | None:
    """The json_schema response_format that enforces a required/named tool_choice (None otherwise)."""
    if plan.mode == "named":
        tool = next(t for t in plan.tools if t["function"]["name"] == plan.named)
        schema = tool_parameters(tool)
    elif plan.mode == "required":
        one = [{"type": "object", "properties": {"name": {"const": t["function"]["name"]},
                                                 "parameters": tool_parameters(t)},
                "required": ["name", "parameters"], "additionalProperties": False} for t in plan.tools]
        schema = one[0] if len(one) == 1 else {"anyOf": one}
        if plan.parallel:
            schema = {"type": "array", "items": schema, "minItems": 1}
    else:
        return None
    return ResponseFormat(type="json_schema", json_schema=JsonSchemaFormat(name="tool_call", schema=schema,
                                                                           strict=True))


# family -> (trigger, header with {name}, end): a call is header + arguments JSON object + end
_CALL_TAGS = {
    "hermes": ("<tool_call>", '<tool_call>\n{"name": "{name}", "arguments": ', "}\n</tool_call>"),
    "llama3_json": ('{"name": ', '{"name": "{name}", "parameters": ', "}"),
    "deepseek_v3": ("<｜tool▁call▁begin｜>", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n",
                    "\n```<｜tool▁call▁end｜>"),
    "deepseek_v31": ("<｜tool▁call▁begin｜>", "<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>", "<｜tool▁call▁end｜>"),
}


@dataclass
class StructuralTagFormat:
    """A ``structural_tag`` response_format (vLLM's shape), as `OpenAIServer.build_constraint` takes one."""

    structures: list[dict[str, Any]]
    triggers: list[str]
    type: str = "structural_tag"

    def model_dump(self, **_: Any) -> dict[str, Any]:
        return {"type": self.type, "structures": self.structures, "triggers": self.triggers}


def strict_tag_format(plan: ToolPlan, tool_parser: str | None) -> StructuralTagFormat | None:
    """auto mode with a ``strict: true`` tool, in a family of `_CALL_TAGS`: the grammar that enforces calls
    once they start (strict tools' schemas; the other tools any object). None otherwise."""
    if plan.mode != "auto" or tool_parser not in _CALL_TAGS:
        return None
    if not any(t["function"].get("strict") for t in plan.tools):
        return None
    trigger, header, end = _CALL_TAGS[tool_parser]
    structures = [{"begin": header.replace("{name}", t["function"]["name"]), "end": end,
                   "schema": tool_parameters(t) if t["function"].get("strict") else {"type": "object"}}
                  for t in plan.tools]
    return StructuralTagFormat(structures, [trigger])
