"""GLM-4.5 / 4.6 / 4.7 / GLM-5: ``<tool_call>NAME\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n...</tool_call>``
(the models' chat templates; 4.7 and 5 drop the newlines). The template writes string values raw and others as
JSON, so a value is kept as a string when the request's tool schema says the parameter is a string, else
JSON-decoded when it is valid JSON (else a string). The arguments object is built as JSON text one finished
pair at a time (so its streamed prefix is stable)."""

from __future__ import annotations

import functools
import json
import re

from tokenfab.server.tools.base import PartialCall, Scan, ToolParser, split_blocks

BEGIN, END = "<tool_call>", "</tool_call>"
KEY = "<arg_key>"
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


@functools.lru_cache(maxsize=4096)
def _pair_json(key: str, raw: str, as_string: bool) -> str:
    """One ``"key": value`` member (cached: streaming rescans the finished pairs on every delta)."""
    return f"{json.dumps(key, ensure_ascii=False)}: {_value_json(raw, as_string)}"


def _value_json(raw: str, as_string: bool) -> str:
    value: object = raw
    if not as_string:
        try:
            value = json.loads(raw)
        except ValueError:
            pass
    return json.dumps(value, ensure_ascii=False)


def _string_params(tools: list[dict] | None) -> dict[str, frozenset[str]]:
    """Tool name -> its parameters whose schema type is only ``string`` (OpenAI ``tools`` entries)."""
    out: dict[str, frozenset[str]] = {}
    for tool in tools or ():
        fn = tool.get("function", tool) if isinstance(tool, dict) else {}
        props = (fn.get("parameters") or {}).get("properties") or {}
        if isinstance(fn.get("name"), str) and isinstance(props, dict):
            out[fn["name"]] = frozenset(
                k for k, v in props.items() if isinstance(v, dict) and v.get("type") in ("string", ["string"])
            )
    return out


class Glm45ToolParser(ToolParser):
    name = "glm45"
    triggers = (BEGIN,)

    def __init__(self, tools: list[dict] | None = None) -> None:
        super().__init__(tools)
        self._strings = _string_params(tools)

    def scan(self, text: str, final: bool) -> Scan:
        segments, blocks = split_blocks(text, BEGIN, END, final)
        return Scan(segments, [_call(body, done, raw, self._strings) for body, done, raw in blocks])


def _call(body: str, done: bool, raw: str, strings: dict[str, frozenset[str]]) -> PartialCall:
    stripped = body.lstrip()
    cuts = [i for i in (stripped.find("\n"), stripped.find(KEY)) if i >= 0]
    if cuts:  # the name is the first line, or what comes before the first <arg_key>
        name = stripped[: min(cuts)].strip()
        pos = len(body) - len(stripped) + min(cuts)
    elif done:
        name, pos = stripped.strip(), len(body)
    else:
        return PartialCall(None, "", done, raw)
    pairs = []
    as_string = strings.get(name, frozenset())
    for m in _PAIR.finditer(body, pos):
        if body[pos : m.start()].strip():
            break
        key = m.group(1).strip()
        pairs.append(_pair_json(key, m.group(2), key in as_string))
        pos = m.end()
    rest = body[pos:].strip()
    args = "{" + ", ".join(pairs) + ("}" if done else "")
    valid = bool(name) and (not done or not rest) and not any(c.isspace() or c == "<" for c in name)
    return PartialCall(name or None, args, done, raw, valid=valid)
