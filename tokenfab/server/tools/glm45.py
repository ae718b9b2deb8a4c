"""GLM-4.5 / 4.6 / 4.7 / GLM-5: ``<tool_call>NAME\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n...</tool_call>``
(the models' chat templates; 4.7 and 5 drop the newlines). Each value is JSON-decoded when it is valid JSON,
else kept as a string, and the arguments object is built as JSON text one finished pair at a time (so its
streamed prefix is stable)."""

from __future__ import annotations

import functools
import json
import re

from tokenfab.server.tools.base import PartialCall, Scan, ToolParser, split_blocks

BEGIN, END = "<tool_call>", "</tool_call>"
KEY = "<arg_key>"
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)


@functools.lru_cache(maxsize=4096)
def _pair_json(key: str, raw: str) -> str:
    """One ``"key": value`` member (cached: streaming rescans the finished pairs on every delta)."""
    return f"{json.dumps(key.strip(), ensure_ascii=False)}: {_value_json(raw)}"


def _value_json(raw: str) -> str:
    try:
        value = json.loads(raw)
    except ValueError:
        value = raw
    return json.dumps(value, ensure_ascii=False)


class Glm45ToolParser(ToolParser):
    name = "glm45"

    def scan(self, text: str, final: bool) -> Scan:
        segments, blocks = split_blocks(text, BEGIN, END, final)
        return Scan(segments, [_call(body, done, raw) for body, done, raw in blocks])


def _call(body: str, done: bool, raw: str) -> PartialCall:
    key_at = body.find(KEY)
    if key_at >= 0:
        name = body[:key_at].strip()
    elif done or "\n" in body.lstrip():
        name = body.strip().split("\n", 1)[0].strip()
    else:
        return PartialCall(None, "", done, raw)
    pairs = []
    pos = key_at if key_at >= 0 else len(body)
    for m in _PAIR.finditer(body, pos):
        if body[pos : m.start()].strip():
            break
        pairs.append(_pair_json(m.group(1), m.group(2)))
        pos = m.end()
    rest = body[pos:].strip()
    args = "{" + ", ".join(pairs) + ("}" if done else "")
    valid = bool(name) and (not done or not rest) and " " not in name
    return PartialCall(name or None, args, done, raw, valid=valid)
