"""Llama-3.x JSON tool calls: the output is ``{"name": ..., "parameters": {...}}`` (``"arguments"`` accepted),
optionally after ``<|python_tag|>``, several calls separated by ``;`` (Meta's Llama 3.1-3.3 prompt format for
JSON-based tool calling). Without the tag, only an output that starts with ``{`` is read as calls."""

from __future__ import annotations

import re

from tokenfab.server.tools.base import PartialCall, Scan, ToolParser, partial_suffix_len
from tokenfab.server.tools.json_call import scan_json_call

PYTHON_TAG = "<|python_tag|>"
_CALL_START = re.compile(r"\s*\{")


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"
    triggers = (PYTHON_TAG,)

    def plain_start(self, text: str) -> bool:
        return _CALL_START.match(text) is None

    def scan(self, text: str, final: bool) -> Scan:
        # an output that starts with "{" is calls from its first character (streaming cannot wait for a tag
        # that may come later); otherwise the calls start after <|python_tag|>
        tag = -1 if text.lstrip().startswith("{") else text.find(PYTHON_TAG)
        if tag >= 0:
            head, start = text[:tag], tag + len(PYTHON_TAG)
        elif text.lstrip().startswith("{"):
            head, start = "", 0
        else:
            keep = len(text) if final else len(text) - partial_suffix_len(text, (PYTHON_TAG,))
            return Scan([text[:keep]], [])
        calls: list[PartialCall] = []
        pos = start
        while True:
            js = scan_json_call(text, pos)
            raw_from = len(head) if not calls else pos  # the first call's text includes the tag
            if js.end is None:
                if js.name is not None or text[pos:].strip() or not calls:
                    calls.append(PartialCall(js.name, js.args, False, text[raw_from:], valid=js.valid))
                break
            calls.append(PartialCall(js.name, js.args, True, text[raw_from : js.end], valid=js.valid))
            rest = text[js.end :].lstrip()
            if not rest:
                break
            if not rest.startswith(";"):  # text after the calls: not this format
                calls[-1].valid = False
                break
            pos = len(text) - len(rest) + 1
        return Scan([head] + [""] * len(calls), calls)
