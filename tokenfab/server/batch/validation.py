"""A batch input file checked line by line when the batch is created: each non-blank line a JSON object with a
string ``custom_id`` (unique in the file), ``method`` "POST", ``url`` equal to the batch's endpoint and an object
``body``. Every bad line is reported by its 1-based number, in OpenAI's batch ``errors.data`` shape; the body
itself is checked only when the line runs (a body the endpoint rejects lands in the error file)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenfab.server.batch.config import MAX_BATCH_LINES

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
MAX_REPORTED_ERRORS = 100
MAX_CUSTOM_ID_CHARS = 512


@dataclass
class InputCheck:
    lines: list[tuple[int, str]] = field(default_factory=list)  # (line number, custom_id) of each request
    errors: list[dict[str, Any]] = field(default_factory=list)  # OpenAI's {code, message, param, line}


def read_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(1-based line number, raw line) of every non-blank line."""
    with open(path, "rb") as f:
        for number, raw in enumerate(f, start=1):
            if raw.strip():
                yield number, raw


def _error(code: str, message: str, line: int | None, param: str | None = None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": param, "line": line}


def check_line(number: int, raw: bytes, endpoint: str, seen: set[str]) -> tuple[str | None, dict[str, Any] | None]:
    """(custom_id, None) for a good line, (None, error) for a bad one."""
    try:
        line = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return None, _error("invalid_json_line", f"Line {number} is not valid JSON: {e}", number)
    if not isinstance(line, dict):
        return None, _error("invalid_json_line", f"Line {number} is not a JSON object", number)
    for name in ("custom_id", "method", "url", "body"):
        if name not in line:
            return None, _error("missing_required_parameter", f"Line {number}: missing required field '{name}'",
                                number, name)
    custom_id, method, url, body = line["custom_id"], line["method"], line["url"], line["body"]
    if not isinstance(custom_id, str) or not custom_id or len(custom_id) > MAX_CUSTOM_ID_CHARS:
        return None, _error("invalid_custom_id", f"Line {number}: custom_id must be a non-empty string of at most "
                            f"{MAX_CUSTOM_ID_CHARS} characters", number, "custom_id")
    if method != "POST":
        return None, _error("invalid_method", f"Line {number}: method must be 'POST', got {method!r}", number,
                            "method")
    if url != endpoint:
        return None, _error("mismatched_url", f"Line {number}: url {url!r} is not the batch's endpoint {endpoint!r}",
                            number, "url")
    if not isinstance(body, dict):
        return None, _error("invalid_body", f"Line {number}: body must be a JSON object", number, "body")
    if custom_id in seen:
        return None, _error("duplicate_custom_id", f"Line {number}: custom_id {custom_id!r} is not unique in the "
                            "file", number, "custom_id")
    seen.add(custom_id)
    return custom_id, None


def check_input(path: Path, endpoint: str) -> InputCheck:
    """Every line of the input file checked (blocking; run it off the event loop)."""
    result = InputCheck()
    seen: set[str] = set()
    bad = 0
    for number, raw in read_lines(path):
        custom_id, error = check_line(number, raw, endpoint, seen)
        if error is not None:
            bad += 1
            if bad <= MAX_REPORTED_ERRORS:
                result.errors.append(error)
        else:
            assert custom_id is not None
            result.lines.append((number, custom_id))
    if not result.lines and not result.errors:
        result.errors.append(_error("empty_file", "The input file has no request lines", None, "input_file_id"))
    if len(result.lines) + bad > MAX_BATCH_LINES:
        result.errors.append(_error("too_many_requests", f"A batch holds at most {MAX_BATCH_LINES} requests, this "
                                    f"file has {len(result.lines) + bad}", None, "input_file_id"))
    return result
