"""Logprobs in OpenAI's two response shapes: completions (parallel lists) and chat (a list of entries)."""

from __future__ import annotations

from typing import Any

from tokenfab.engine.outputs import Logprob


def token_str(lp: dict[int, Logprob], tok: int, tokenizer: Any) -> str:
    entry = lp.get(tok)
    if entry is not None:
        return entry.decoded_token
    return tokenizer.decode([tok])


def top(lp: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    return sorted(((t, v) for t, v in lp.items() if v.rank <= k), key=lambda x: x[1].rank)[:k]


def finite(x: float) -> float:
    # JSON has no -inf: report a very negative number instead
    return x if x > -1e30 else -9999.0


def completion_logprobs(tokenizer: Any, token_ids: list[int], lps: list[dict[int, Logprob]], k: int,
                        echo_ids: list[int] | None, offset: int) -> dict[str, Any]:
    """Completions' ``logprobs`` object: tokens, token_logprobs, top_logprobs, text_offset."""
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    pos = 0
    if echo_ids:
        # The engine does not compute prompt logprobs: the echoed prompt tokens carry null.
        for t in echo_ids:
            s = tokenizer.decode([t])
            out["tokens"].append(s)
            out["token_logprobs"].append(None)
            out["top_logprobs"].append(None)
            out["text_offset"].append(pos)
            pos += len(s)
        pos = offset
    for tok, lp in zip(token_ids, lps):
        s = token_str(lp, tok, tokenizer)
        entry = lp.get(tok)
        out["tokens"].append(s)
        out["token_logprobs"].append(finite(entry.logprob) if entry is not None else None)
        out["top_logprobs"].append({v.decoded_token: finite(v.logprob) for _, v in top(lp, k)})
        out["text_offset"].append(pos)
        pos += len(s)
    return out


def chat_logprobs(tokenizer: Any, token_ids: list[int], lps: list[dict[int, Logprob]], k: int) -> list[dict]:
    """Chat's ``logprobs.content`` list."""
    content = []
    for tok, lp in zip(token_ids, lps):
        s = token_str(lp, tok, tokenizer)
        entry = lp.get(tok)
        content.append({
            "token": s, "logprob": finite(entry.logprob) if entry is not None else -9999.0,
            "bytes": list(s.encode("utf-8")),
            "top_logprobs": [{"token": v.decoded_token, "logprob": finite(v.logprob),
                              "bytes": list(v.decoded_token.encode("utf-8"))} for _, v in top(lp, k)],
        })
    return content
