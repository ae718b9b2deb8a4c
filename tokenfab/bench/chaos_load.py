"""The bounded load of a chaos run: a fixed number of concurrent streams, each sending one request after another
(short prompts, a few tokens, chat and completions, streamed and not), and the outcome of every request sent.

Every request gets exactly one outcome, from the client's view:
- ``ok``: a 200 with a finished choice (non-streamed), or a stream with a ``finish_reason`` and ``[DONE]``;
- ``retryable_503``: an HTTP 503 carrying ``Retry-After``;
- ``stream_503``: a stream whose 200 was already sent when the engine died, ended by an in-band error event with
  code ``service_unavailable`` and ``[DONE]`` (the status cannot change once sent: this is the stream's 503);
- ``router_503``: a 503 the router wrote itself (not OpenAI's error body: "No available workers" while every
  instance is down); vllm-router 0.1.17 sends no ``Retry-After`` with it and has no setting for one;
- ``router_5xx``: another 5xx the router wrote itself (vllm-router answers 500 "Request failed: error sending
  request" for a non-streamed request whose server was SIGKILLed while it was in flight);
- ``503_no_retry_after``, ``other_5xx`` (tokenfab's), ``other_4xx``, ``stream_error`` (an in-band error, not a 503);
- ``dropped``: the connection ended without a complete answer (no status, or a stream cut before ``[DONE]``);
- ``timeout``: no answer within the request timeout; ``client_error``: the generator itself failed on the answer.
``lost`` = requests sent - outcomes recorded: a request the generator cannot account for (must be 0).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import time
from dataclasses import dataclass

import httpx

RETRYABLE = ("retryable_503", "stream_503")
OUTCOMES = ("ok", *RETRYABLE, "router_503", "router_5xx", "503_no_retry_after", "other_5xx", "other_4xx",
            "stream_error", "dropped", "timeout", "client_error")
PROMPTS = ("Name a color.", "Count to five.", "Say hello in French.", "What is 2 + 2?", "Give a fruit.",
           "Write one word.", "Name a planet.", "Spell cat.")
KINDS = (("chat", True), ("chat", False), ("completion", True), ("completion", False))


@dataclass
class Record:
    id: int
    kind: str
    stream: bool
    start: float  # monotonic
    end: float = 0.0
    outcome: str = ""
    status: int | None = None
    detail: str = ""


def _body(kind: str, stream: bool, model: str, rng: random.Random) -> tuple[str, dict]:
    prompt, max_tokens = rng.choice(PROMPTS), rng.randint(4, 12)
    body: dict = {"model": model, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    if kind == "chat":
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


def _classify_status(rec: Record, status: int, headers: httpx.Headers, text: str) -> None:
    rec.status = status
    if status == 503:
        rec.outcome = "retryable_503" if "retry-after" in headers else \
            "503_no_retry_after" if _openai_error(text) else "router_503"
    elif status >= 500:
        rec.outcome = "other_5xx" if _openai_error(text) else "router_5xx"
    else:
        rec.outcome = "other_4xx"
    rec.detail = text[:200]


def _openai_error(text: str) -> bool:
    try:
        return isinstance(json.loads(text).get("error"), dict)
    except (ValueError, AttributeError):
        return False


async def _plain(client: httpx.AsyncClient, url: str, body: dict, rec: Record) -> None:
    r = await client.post(url, json=body)
    if r.status_code != 200:
        return _classify_status(rec, r.status_code, r.headers, r.text)
    rec.status = 200
    choices = r.json().get("choices") or []
    rec.outcome = "ok" if choices and choices[0].get("finish_reason") else "dropped"
    if rec.outcome != "ok":
        rec.detail = "200 without a finished choice: " + r.text[:160]


async def _streamed(client: httpx.AsyncClient, url: str, body: dict, rec: Record) -> None:
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            text = (await r.aread()).decode("utf-8", "replace")
            return _classify_status(rec, r.status_code, r.headers, text)
        rec.status = 200
        finished = done = False
        error: dict | None = None
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[6:]
            if data == "[DONE]":
                done = True
                continue
            event = json.loads(data)
            if "error" in event:
                error = event["error"]
            elif any(c.get("finish_reason") for c in event.get("choices") or []):
                finished = True
    if error is not None:
        rec.outcome = "stream_503" if error.get("code") == "service_unavailable" and done else "stream_error"
        rec.detail = str(error.get("message", ""))[:200]
    elif finished and done:
        rec.outcome = "ok"
    else:
        rec.outcome, rec.detail = "dropped", f"stream ended without {'[DONE]' if finished else 'a finish_reason'}"


class LoadGenerator:
    """``streams`` concurrent loops against ``base`` until ``stop`` is set, then the in-flight requests finish."""

    def __init__(self, base: str, model: str, streams: int, timeout: float = 120.0, seed: int = 0) -> None:
        self.base, self.model, self.streams, self.timeout = base, model, streams, timeout
        self.rng = random.Random(seed)
        self.records: list[Record] = []
        self.sent = 0
        self._ids = itertools.count()

    async def _one(self, client: httpx.AsyncClient, kind: str, stream: bool) -> None:
        path, body = _body(kind, stream, self.model, self.rng)
        rec = Record(next(self._ids), kind, stream, time.monotonic())
        self.sent += 1
        try:
            await asyncio.wait_for((_streamed if stream else _plain)(client, self.base + path, body, rec), self.timeout)
        except (TimeoutError, httpx.TimeoutException):
            rec.outcome, rec.detail = "timeout", f"no answer within {self.timeout:.0f} s"
        except httpx.HTTPError as e:
            rec.outcome, rec.detail = "dropped", f"{type(e).__name__}: {e}"[:200]
        except ValueError as e:  # a body that is not JSON
            rec.outcome, rec.detail = "dropped", f"unreadable answer: {e}"[:200]
        except Exception as e:  # anything else is still this request's outcome, never a silent loss
            rec.outcome, rec.detail = "client_error", f"{type(e).__name__}: {e}"[:200]
        finally:
            rec.end = time.monotonic()
            if rec.outcome:
                self.records.append(rec)

    async def _loop(self, client: httpx.AsyncClient, k: int, stop: asyncio.Event) -> None:
        kinds = itertools.cycle(KINDS[k % len(KINDS):] + KINDS[:k % len(KINDS)])
        while not stop.is_set():
            kind, stream = next(kinds)
            await self._one(client, kind, stream)

    async def run(self, stop: asyncio.Event) -> None:
        limits = httpx.Limits(max_connections=self.streams + 4, max_keepalive_connections=self.streams)
        async with httpx.AsyncClient(timeout=httpx.Timeout(self.timeout, connect=10), limits=limits) as client:
            await asyncio.gather(*(self._loop(client, k, stop) for k in range(self.streams)))

    def summary(self) -> dict:
        counts = {o: 0 for o in OUTCOMES}
        for rec in self.records:
            counts[rec.outcome] = counts.get(rec.outcome, 0) + 1
        latencies = sorted(r.end - r.start for r in self.records if r.outcome == "ok")
        return {"sent": self.sent, "accounted": len(self.records), "lost": self.sent - len(self.records),
                "outcomes": counts,
                "ok_latency_p50_s": _pct(latencies, 0.5), "ok_latency_p99_s": _pct(latencies, 0.99)}


def _pct(xs: list[float], q: float) -> float | None:
    return round(xs[min(len(xs) - 1, int(q * len(xs)))], 3) if xs else None
