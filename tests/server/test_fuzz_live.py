"""The live server on the bundled model, under hostile and fuzzed traffic: innocent clients are
served while hostile requests are refused, nothing hostile reaches the engine's steps, and greedy
output is unchanged afterwards (the same tokens as ``LLM.generate``)."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tests.server.conftest import GREEDY_MAX_TOKENS, GREEDY_PROMPTS
from tests.server.fuzzing import run_schemathesis


def _hostile(model: str, vocab: int) -> list[tuple[str, str, int]]:
    """(url, raw JSON body, expected status): the requests of issue 12, sent as raw bytes."""
    hi = {"model": model, "prompt": "hi", "max_tokens": 4}
    cases = [
        ("/v1/completions", {**hi, "stop_token_ids": [vocab + 7], "min_tokens": 2}, 400),
        ("/v1/completions", {**hi, "top_k": 2**63}, 400),
        ("/v1/completions", {**hi, "seed": 2**64}, 400),
        ("/v1/completions", {**hi, "prompt": [1, -5, 2]}, 400),
        ("/v1/completions", {**hi, "prompt": [[1, 2], [vocab]]}, 400),
        ("/v1/completions", {**hi, "logit_bias": {str(vocab + 1): 5}}, 400),
        ("/v1/completions", {**hi, "prompt": "bad \ud800 text"}, 400),
        ("/v1/completions", {**hi, "priority": 9}, 400),
        ("/v1/completions", {**hi, "prompt": ["a"] * 1000}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "\udfff"}]}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "chat_template": "{% for x in range(10**9) %}x{% endfor %}"}, 400),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "chat_template_kwargs": {"tokenize": True}}, 400),
        ("/tokenize", {"prompt": "\ud800"}, 400),
        ("/v1/completions", {**hi, "prompt": "x" * (9 << 20)}, 413),
    ]
    return [(url, json.dumps(body), status) for url, body, status in cases]


async def _innocent_and_hostile(url: str, model: str, vocab: int) -> tuple[list[str], list[httpx.Response]]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        async def innocent(prompt: str) -> str:
            text = ""
            async with c.stream("POST", "/v1/completions", json={
                    "model": model, "prompt": prompt, "max_tokens": GREEDY_MAX_TOKENS, "temperature": 0,
                    "stream": True}) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: ") and line != "data: [DONE]":
                        text += json.loads(line[6:])["choices"][0]["text"]
            return text

        async def hostile(path: str, body: str) -> httpx.Response:
            return await c.post(path, content=body, headers={"Content-Type": "application/json"})

        tasks = [innocent(p) for p in GREEDY_PROMPTS]
        tasks += [hostile(path, body) for path, body, _ in _hostile(model, vocab)]
        results = await asyncio.gather(*tasks)
    n = len(GREEDY_PROMPTS)
    return list(results[:n]), list(results[n:])


def _greedy_unchanged(served, http) -> None:
    for prompt, expected in zip(GREEDY_PROMPTS, served.expected_completions):
        resp = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": GREEDY_MAX_TOKENS,
                                                  "temperature": 0})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == expected.outputs[0].text
    assert http.get("/health").json() == {"status": "ok"}


def test_innocent_clients_served_while_hostile_requests_are_refused(served, http):
    vocab = served.engine.vocab_size
    texts, hostile = asyncio.run(_innocent_and_hostile(served.url, served.model, vocab))
    for text, expected in zip(texts, served.expected_completions):
        assert text == expected.outputs[0].text
    for (path, body, status), resp in zip(_hostile(served.model, vocab), hostile):
        assert resp.status_code == status, (path, body[:200], resp.text[:300])
        err = resp.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert not served.engine.is_dead
    _greedy_unchanged(served, http)


def _live_fuzz(served, http, max_examples: int) -> None:
    import schemathesis

    schema = schemathesis.openapi.from_url(f"{served.url}/openapi.json")
    report = run_schemathesis(schema, max_examples=max_examples, cap_generation=4, timeout=300)
    summary = {k: v for k, v in report.as_dict().items() if k != "by_operation"}
    print(f"\nschemathesis live ({max_examples} examples per operation and mode): {json.dumps(summary)}")
    assert report.server_errors == 0, report.failures
    assert not report.failures, "\n".join(report.failures)
    _greedy_unchanged(served, http)


def test_schemathesis_live_short(served, http):
    _live_fuzz(served, http, max_examples=8)


@pytest.mark.slow
def test_schemathesis_live_long(served, http):
    _live_fuzz(served, http, max_examples=30)
