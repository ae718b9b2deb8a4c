"""Kimi K2 / K2.5: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>
{...}<|tool_call_end|>...<|tool_calls_section_end|>``. The call id is the model's own ``functions.NAME:IDX``
(the chat template writes it back as the tool message's id), so it is kept rather than replaced."""

from __future__ import annotations

from tokenfab.server.tools.base import PartialCall, Scan, ToolParser, split_blocks

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, CALL_END, ARG_BEGIN = "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"


def name_from_id(call_id: str) -> str:
    """``functions.get_weather:0`` -> ``get_weather``."""
    name = call_id.rsplit(":", 1)[0] if ":" in call_id else call_id
    return name.removeprefix("functions.")


class KimiK2ToolParser(ToolParser):
    name = "kimi_k2"
    triggers = (CALL_BEGIN, SECTION_BEGIN, SECTION_END)

    def scan(self, text: str, final: bool) -> Scan:
        segments, blocks = split_blocks(text, CALL_BEGIN, CALL_END, final, drop=(SECTION_BEGIN, SECTION_END))
        calls = []
        for body, done, raw in blocks:
            at = body.find(ARG_BEGIN)
            if at < 0:
                calls.append(PartialCall(None, "", done, raw, valid=not done))
                continue
            call_id = body[:at].strip()
            args = body[at + len(ARG_BEGIN) :]
            args = args.strip() if done else args.lstrip().rstrip()
            name = name_from_id(call_id) or None
            calls.append(PartialCall(name, args, done, raw, call_id=call_id or None))
        return Scan(segments, calls)
