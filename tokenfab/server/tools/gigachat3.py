"""GigaChat3: the assistant turn ends in ``function call<|role_sep|>\\n{"name": ..., "arguments": {...}}``
(GigaChat3.1 writes ``<|function_call|>`` instead; some outputs omit ``<|role_sep|>``). One call per message;
content may come before it. The words "function call" count as the marker only when a JSON object follows, so
prose that mentions a function call stays content."""

from __future__ import annotations

from tokenfab.server.tools.base import PartialCall, Scan, ToolParser, partial_suffix_len
from tokenfab.server.tools.json_call import scan_json_call

PHRASE, ROLE_SEP, TOKEN = "function call", "<|role_sep|>", "<|function_call|>"
MARKERS = (PHRASE, TOKEN)
_WS = " \t\r\n"


def _find_call(text: str, final: bool) -> tuple[int, int | None] | None:
    """`(marker start, JSON start)` of the call; JSON start None while it may still turn out to be a call;
    None when there is no call."""
    pos = 0
    while True:
        hits = [(i, m) for m in MARKERS if (i := text.find(m, pos)) >= 0]
        if not hits:
            return None
        at, marker = min(hits)
        j = at + len(marker)
        if marker == PHRASE:
            if text.startswith(ROLE_SEP, j):
                j += len(ROLE_SEP)
            elif not final and text[j:] and ROLE_SEP.startswith(text[j:]):
                return at, None
        while j < len(text) and text[j] in _WS:
            j += 1
        if j == len(text) and not final:
            return at, None
        if j < len(text) and text[j] == "{":
            return at, j
        pos = at + 1


class GigaChat3ToolParser(ToolParser):
    name = "gigachat3"
    triggers = MARKERS

    def scan(self, text: str, final: bool) -> Scan:
        found = _find_call(text, final)
        if found is None:
            keep = len(text) if final else len(text) - partial_suffix_len(text, MARKERS)
            return Scan([text[:keep]], [])
        at, start = found
        if start is None:  # hold the marker back until we know
            return Scan([text[:at]], [])
        js = scan_json_call(text, start)
        done = js.end is not None
        valid = js.valid and (not done or not text[js.end :].strip())
        call = PartialCall(js.name, js.args, done, text[at:], valid=valid)
        return Scan([text[:at], ""], [call])
