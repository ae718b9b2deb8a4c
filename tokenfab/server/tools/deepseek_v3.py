"""DeepSeek-V3 (and R1-0528) tool calls, as the model's chat template renders past calls:
``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``,
more calls, then ``<｜tool▁calls▁end｜>``."""

from __future__ import annotations

from tokenfab.server.tools.base import PartialCall, Scan, ToolParser, split_blocks

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```"


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseek_v3"
    triggers = (CALL_BEGIN, CALLS_BEGIN, CALLS_END)

    def scan(self, text: str, final: bool) -> Scan:
        segments, blocks = split_blocks(text, CALL_BEGIN, CALL_END, final, drop=(CALLS_BEGIN, CALLS_END))
        return Scan(segments, [_call(body, done, raw) for body, done, raw in blocks])


def _call(body: str, done: bool, raw: str) -> PartialCall:
    sep = body.find(SEP)
    if sep < 0:
        return PartialCall(None, "", done, raw, valid=not done)
    kind, rest = body[:sep].strip(), body[sep + len(SEP) :]
    newline = rest.find("\n")
    if newline < 0:  # the name is complete only at its newline
        return PartialCall(None, "", done, raw, valid=not done)
    name = rest[:newline].strip()
    rest = rest[newline + 1 :].lstrip()
    if not rest.startswith(FENCE):
        ok = not done and FENCE.startswith(rest)
        return PartialCall(name, "", done, raw, valid=ok)
    rest = rest[len(FENCE) :]
    if rest.startswith("json"):
        rest = rest[4:]
    elif not done and "json".startswith(rest):  # the fence's language tag is still arriving
        return PartialCall(name, "", done, raw)
    close = rest.find(FENCE)
    if close >= 0:
        valid = kind in ("function", "") and not rest[close + len(FENCE) :].strip()
        return PartialCall(name, rest[:close].strip(), done, raw, valid=valid)
    return PartialCall(name, rest.lstrip().rstrip(" \t\r\n`"), done, raw, valid=not done)
