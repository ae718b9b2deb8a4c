"""Hermes / Qwen2.5 / Qwen3: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``, one block per
call, several blocks for parallel calls (the Qwen chat templates' tool instructions)."""

from __future__ import annotations

from tokenfab.server.tools.base import PartialCall, Scan, ToolParser, split_blocks
from tokenfab.server.tools.json_call import scan_json_call

BEGIN, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    triggers = (BEGIN,)

    def scan(self, text: str, final: bool) -> Scan:
        segments, blocks = split_blocks(text, BEGIN, END, final)
        calls = []
        for body, done, raw in blocks:
            js = scan_json_call(body)
            valid = js.valid and (not done or (js.end is not None and not body[js.end :].strip()))
            calls.append(PartialCall(js.name, js.args, done and js.end is not None, raw, valid=valid))
        return Scan(segments, calls)
