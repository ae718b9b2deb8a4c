"""DeepSeek-V3.1 (also V3.2-Exp):
``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>``
(the V3.1 chat template's tool-call format; no ``function`` type, no code fence)."""

from __future__ import annotations

from tokenfab.server.tools.base import PartialCall, Scan, ToolParser, split_blocks
from tokenfab.server.tools.deepseek_v3 import CALL_BEGIN, CALL_END, CALLS_BEGIN, CALLS_END, SEP


class DeepSeekV31ToolParser(ToolParser):
    name = "deepseek_v31"
    triggers = (CALL_BEGIN, CALLS_BEGIN, CALLS_END)

    def scan(self, text: str, final: bool) -> Scan:
        segments, blocks = split_blocks(text, CALL_BEGIN, CALL_END, final, drop=(CALLS_BEGIN, CALLS_END))
        calls = []
        for body, done, raw in blocks:
            sep = body.find(SEP)
            if sep < 0:
                calls.append(PartialCall(None, "", done, raw, valid=not done))
                continue
            args = body[sep + len(SEP) :]
            args = args.strip() if done else args.lstrip().rstrip()
            calls.append(PartialCall(body[:sep].strip() or None, args, done, raw))
        return Scan(segments, calls)
