"""Incremental reading of a JSON call object ``{"name": ..., "arguments": {...}}`` (Hermes, Llama-3, GigaChat3).

`scan_json_call` walks the top-level keys of a possibly unfinished object and returns the name once its string
is complete and the raw text of the arguments value as far as it has arrived. Streaming the raw text (not a
re-serialisation of a partial parse) keeps every prefix stable, so argument deltas concatenate to exactly the
final arguments text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

_WS = " \t\r\n"
ARG_KEYS = ("arguments", "parameters")


@dataclass
class JsonCallScan:
    name: str | None
    args: str  # raw arguments text so far ("" until it starts; "{}" when the object closed without one)
    end: int | None  # index just past the object's closing brace, None while open
    valid: bool  # False when what arrived cannot be a call object


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in _WS:
        i += 1
    return i


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_DECODER = json.JSONDecoder()


def _string_end(s: str, i: int) -> int | None:
    """`s[i]` is a quote: index just past the closing quote, or None if the string is unfinished."""
    m = _STRING.match(s, i)
    return m.end() if m else None


def _value_end(s: str, i: int) -> int | None:
    """Index just past the JSON value starting at `s[i]`, or None if it is unfinished (or malformed, which
    leaves the call unfinished and so returns it as content). Objects and arrays are measured by the C JSON
    decoder: a streaming rescan costs microseconds, not a Python loop over every character."""
    if s[i] == '"':
        return _string_end(s, i)
    if s[i] in "{[":
        try:
            return _DECODER.raw_decode(s, i)[1]
        except ValueError:
            return None
    j = i
    while j < len(s) and s[j] not in ",}]" + _WS:
        j += 1
    return j if j < len(s) else None


def scan_json_call(s: str, start: int = 0) -> JsonCallScan:
    """Read the call object starting at the first non-space character at or after `start`."""
    i = _skip_ws(s, start)
    if i >= len(s):
        return JsonCallScan(None, "", None, True)
    if s[i] != "{":
        return JsonCallScan(None, "", None, False)
    name: str | None = None
    args = ""
    has_args = False
    i += 1
    while True:
        i = _skip_ws(s, i)
        if i >= len(s):
            return JsonCallScan(name, args, None, True)
        if s[i] == "}":
            return JsonCallScan(name, args if has_args else "{}", i + 1, name is not None)
        if s[i] == ",":
            i += 1
            continue
        if s[i] != '"':
            return JsonCallScan(name, args, None, False)
        k_end = _string_end(s, i)
        if k_end is None:
            return JsonCallScan(name, args, None, True)
        try:
            key = json.loads(s[i:k_end])
        except ValueError:  # e.g. an invalid escape
            return JsonCallScan(name, args, None, False)
        i = _skip_ws(s, k_end)
        if i >= len(s):
            return JsonCallScan(name, args, None, True)
        if s[i] != ":":
            return JsonCallScan(name, args, None, False)
        i = _skip_ws(s, i + 1)
        if i >= len(s):
            return JsonCallScan(name, args, None, True)
        v_end = _value_end(s, i)
        if key == "name" and v_end is not None:
            value = _decoded_string(s[i:v_end]) if s[i] == '"' else None
            if not isinstance(value, str):
                return JsonCallScan(None, args, None, False)
            name = value
        elif key in ARG_KEYS:
            has_args = True
            if s[i] == '"':  # arguments sent as a JSON-encoded string: usable only when complete
                args = (_decoded_string(s[i:v_end]) or "") if v_end is not None else ""
            else:
                args = s[i:v_end] if v_end is not None else s[i:]
        if v_end is None:
            return JsonCallScan(name, args, None, True)
        i = v_end


def _decoded_string(text: str) -> str | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return value if isinstance(value, str) else None
