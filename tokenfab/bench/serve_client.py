"""One request of `tokenfab bench serve`, streamed or not, and how its timings are read.

Streamed: the time to the first chunk with text is the TTFT; every later token adds one
inter-token latency (ITL). A server may put several tokens in one SSE chunk (a token held back
by the detokenizer, a stop string being matched, a server that sends a step's tokens at once),
so the ITL is counted per token, not per chunk: a chunk that brings k tokens after a gap of dt
gives k intervals of dt/k, and the extra tokens of the first chunk arrive with the first token
(intervals of 0). The sum of a request's ITLs is then the time from its first token to its last,
and their count is its output tokens - 1, so the mean ITL is the TPOT.

How many tokens each chunk holds: from the chunk's own ``usage`` when the server sends running
usage (vLLM's ``continuous_usage_stats``); else, when the chunks are as many as the final
usage's ``completion_tokens`` (or ``max_tokens`` for a stream that ended on length and sent no
usage), one each; else the tokens are spread evenly over the chunks after
the first, the remainder to the chunks after the longest gaps (``token_counts = "estimated"`` in
the report).

Not streamed (``stream: false``): only the end-to-end latency and the token counts exist.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestResult:
    ok: bool
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float | None = None  # seconds; None when not streamed
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)
    token_counts: str = ""  # "usage", "one per chunk", "estimated" or "" (not streamed)

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens <= 1:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)


def tokens_per_chunk(chunks: int, total: int | None, running: list[int | None],
                     gaps: list[float] | None = None) -> tuple[list[float], str]:
    """How many tokens each of ``chunks`` text chunks held. ``running`` is each chunk's cumulative
    ``completion_tokens`` when the server reported one (else None); ``total`` the final usage's;
    ``gaps`` the times between consecutive chunks. Estimated counts are whole numbers that add up
    to ``total``: the tokens after the first spread evenly over the later chunks, the remainder to
    the chunks after the longest gaps (a chunk that brings more tokens waited longer for them)."""
    if chunks and all(r is not None for r in running):
        counts, prev = [], 0
        for r in running:
            counts.append(float(max(r - prev, 0)))
            prev = max(prev, r)
        return counts, "usage"
    if total is None or total <= chunks:
        return [1.0] * chunks, "one per chunk"
    if chunks == 1:
        return [float(total)], "estimated"
    later = chunks - 1
    base, rem = divmod(total - 1, later)
    counts = [float(base)] * later
    by_gap = sorted(range(later), key=lambda i: -(gaps[i] if gaps else 0.0))
    for i in by_gap[:rem]:
        counts[i] += 1
    return [1.0, *counts], "estimated"


def itls_per_token(times: list[float], counts: list[float]) -> list[float]:
    """Inter-token latencies of a stream whose text chunks arrived at ``times`` holding ``counts``
    tokens: the first chunk's extra tokens give intervals of 0, a later chunk of k tokens after a
    gap dt gives k intervals of dt/k."""
    out: list[float] = []
    for i, (t, k) in enumerate(zip(times, counts)):
        if i == 0:
            out += [0.0] * max(int(round(k)) - 1, 0)
            continue
        if k <= 0:  # a chunk with text but no new token (e.g. a held-back tail released)
            continue
        dt = t - times[i - 1]
        out += [dt / k] * max(int(round(k)), 1)
    return out


def _chunk_text(msg: dict[str, Any]) -> bool:
    for choice in msg.get("choices") or []:
        text = choice.get("text")
        if text is None:
            text = (choice.get("delta") or {}).get("content")
        if text:
            return True
    return False


async def one_streamed(client: Any, url: str, payload: dict[str, Any], timeout: float) -> RequestResult:
    start = time.perf_counter()
    times: list[float] = []
    running: list[int | None] = []
    usage: dict[str, Any] | None = None
    finish = None
    try:
        async with client.stream("POST", url, json=payload, timeout=timeout) as resp:
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                return RequestResult(False, f"HTTP {resp.status_code}: {body[:200]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if "error" in msg:
                    return RequestResult(False, str(msg["error"])[:200])
                if msg.get("usage"):
                    usage = msg["usage"]
                finish = next((c["finish_reason"] for c in msg.get("choices") or [] if c.get("finish_reason")),
                              finish)
                if _chunk_text(msg):
                    times.append(time.perf_counter())
                    u = msg.get("usage") or {}
                    running.append(int(u["completion_tokens"]) if "completion_tokens" in u else None)
    except Exception as e:  # network errors, timeouts, a malformed body
        return RequestResult(False, f"{type(e).__name__}: {e}"[:200])
    if not times:
        return RequestResult(False, "no tokens received")
    total = int(usage["completion_tokens"]) if usage and "completion_tokens" in usage else None
    if total is None and finish == "length" and payload.get("max_tokens"):
        total = int(payload["max_tokens"])  # no usage sent (llama.cpp streams none): it ran to max_tokens
    gaps = [b - a for a, b in zip(times, times[1:])]
    counts, how = tokens_per_chunk(len(times), total, running, gaps)
    out_tokens = total if total is not None else int(round(sum(counts)))
    prompt_tokens = int(usage.get("prompt_tokens", 0)) if usage else 0
    return RequestResult(True, prompt_tokens=prompt_tokens, output_tokens=out_tokens, ttft=times[0] - start,
                         e2e=times[-1] - start, itls=itls_per_token(times, counts), token_counts=how)


async def one_plain(client: Any, url: str, payload: dict[str, Any], timeout: float) -> RequestResult:
    """A non-streamed request: end-to-end latency and token counts only."""
    start = time.perf_counter()
    try:
        resp = await client.post(url, json={**payload, "stream": False}, timeout=timeout)
        if resp.status_code != 200:
            return RequestResult(False, f"HTTP {resp.status_code}: {resp.text[:200]}")
        body = resp.json()
    except Exception as e:
        return RequestResult(False, f"{type(e).__name__}: {e}"[:200])
    end = time.perf_counter()
    if "error" in body:
        return RequestResult(False, str(body["error"])[:200])
    usage = body.get("usage") or {}
    if "completion_tokens" not in usage:
        return RequestResult(False, "no usage in the response")
    return RequestResult(True, prompt_tokens=int(usage.get("prompt_tokens", 0)),
                         output_tokens=int(usage["completion_tokens"]), e2e=end - start)
