"""Streamed completions cut short on purpose: the server or a process is signalled after the first token."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import httpx


def first_token(lines: Iterator[str]) -> None:
    """Consume an SSE completion stream up to its first chunk with text."""
    for line in lines:
        if line.startswith("data: ") and line != "data: [DONE]":
            ch = json.loads(line[6:])["choices"]
            if ch and ch[0].get("text"):
                return
    raise AssertionError("stream ended before a token")


def interrupt_stream(c: httpx.Client, body: dict, action: Callable[[], None]) -> tuple[list[str], float, float]:
    """Stream ``body`` from /v1/completions, run ``action`` after the first token, read the stream to its
    end (no hang). Returns the lines after the first token, when ``action`` was called (``time.monotonic``)
    and how many seconds later the stream ended."""
    with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first_token(lines)
        t0 = time.monotonic()
        action()
        rest = list(lines)
        return rest, t0, time.monotonic() - t0


def completion_text(c: httpx.Client, body: dict, stream: bool) -> str:
    """Choice 0's text of a /v1/completions request, streamed (the chunks' texts joined) or not."""
    body = dict(body, stream=stream)
    if not stream:
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["text"]
    text = ""
    with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def data_events(lines: list[str]) -> list[dict]:
    """The JSON chunks among SSE lines."""
    return [json.loads(x[6:]) for x in lines if x.startswith("data: {")]
