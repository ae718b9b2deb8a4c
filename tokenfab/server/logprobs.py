"""Logprobs in OpenAI's two response shapes: completions (parallel lists) and chat (a list of entries)."""

from __future__ import annotations

from typing import Any

from tokenfab.engine.requests.outputs import Logprob


def token_str(lp: dict[int, Logprob] | None, tok: int, tokenizer: Any) -> str:
    entry = lp.get(tok) if lp else None
    if entry is not None:
        return entry.decoded_token
    return tokenizer.decode([tok])


def top(lp: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    return sorted(((t, v) for t, v in lp.items() if v.rank <= k), key=lambda x: x[1].rank)[:k]


def finite(x: float) -> float:
    # JSON has no -inf: report a very negative number instead
    return x if x > -1e30 else -9999.0


def completion_logprobs(tokenizer: Any, token_ids: list[int], lps: list[dict[int, Logprob]], k: int,
                        echo_ids: list[int] | None = None,
                        prompt_lps: list[dict[int, Logprob] | None] | None = None,
                        offset: int = 0) -> dict[str, Any]:
    """Completions' ``logprobs`` object: tokens, token_logprobs, top_logprobs, text_offset.

    With ``echo_ids`` the prompt's tokens come first, scored by ``prompt_lps`` (the engine's prompt
    logprobs: the first token has none, so its entries are null, as in OpenAI's and vLLM's answers);
    the prompt's top alternatives hold the ``k`` most likely tokens plus the prompt's own token.
    Generated tokens' text offsets start at ``offset`` (the echoed prompt's length in characters).
    """
    out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    pos = 0
    if echo_ids:
        for i, t in enumerate(echo_ids):
            lp = prompt_lps[i] if prompt_lps is not None and i < len(prompt_lps) else None
            s = token_str(lp, t, tokenizer) if lp else tokenizer.decode([t])
            out["tokens"].append(s)
            entry = lp.get(t) if lp else None
            out["token_logprobs"].append(finite(entry.logprob) if entry is not None else None)
            if lp:
                tops = {v.decoded_token: finite(v.logprob) for _, v in top(lp, k)}
                if entry is not None:
                    tops.setdefault(entry.decoded_token, finite(entry.logprob))
                out["top_logprobs"].append(tops)
            else:
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


def prompt_logprobs_json(prompt_lps: list[dict[int, Logprob] | None] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's ``prompt_logprobs`` field: per prompt token, None (the first) or
    ``{token_id: {"logprob", "rank", "decoded_token"}}`` (JSON keys are strings)."""
    if prompt_lps is None:
        return None
    return [None if lp is None else
            {str(t): {"logprob": finite(v.logprob), "rank": v.rank, "decoded_token": v.decoded_token}
             for t, v in lp.items()}
            for lp in prompt_lps]


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
