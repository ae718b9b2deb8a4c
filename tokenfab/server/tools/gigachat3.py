"""GigaChat3: the assistant turn ends in ``function call<|role_sep|>\\n{"name": ..., "arguments": {...}}``
(GigaChat3.1 writes ``<|function_call|>`` instead); one call per message, content may come before it."""

from __future__ import annotations

from tokenfab.server.tools.base import PartialCall, Scan, ToolParser, partial_suffix_len
from tokenfab.server.tools.json_call import scan_json_call

MARKERS = ("function call<|role_sep|>", "<|function_call|>")


class GigaChat3ToolParser(ToolParser):
    name = "gigachat3"

    def scan(self, text: str, final: bool) -> Scan:
        hits = [(text.find(m), m) for m in MARKERS if m in text]
        if not hits:
            keep = len(text) if final else len(text) - partial_suffix_len(text, MARKERS)
            return Scan([text[:keep]], [])
        at, marker = min(hits)
        js = scan_json_call(text, at + len(marker))
        done = js.end is not None
        valid = js.valid and (not done or not text[js.end :].strip())
        call = PartialCall(js.name, js.args, done, text[at:], valid=valid)
        return Scan([text[:at], ""], [call])
