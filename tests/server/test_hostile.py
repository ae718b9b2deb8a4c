"""Hostile and malformed requests against the app in process (fake engine: no model, fast).

Each is refused before anything is queued, with OpenAI's error body naming the field; a request
that fails inside the engine answers alone; a dead engine answers 503 everywhere."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tests.server.fake_engine import VOCAB, FakeEngine
from tests.server.inprocess import assert_error, fake_server, gather_posts, post, sse_events
from tokenfab.engine.core.async_engine import AsyncEngine
from tokenfab.server.app import ServerConfig, build_app

HI = {"prompt": "hi", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}

BAD_COMPLETIONS = [
    ("stop_token_ids outside the vocabulary", {**HI, "stop_token_ids": [VOCAB + 5], "min_tokens": 2},
     "stop_token_ids"),
    ("stop_token_ids negative", {**HI, "stop_token_ids": [-1]}, "stop_token_ids.0"),
    ("prompt token negative", {"prompt": [1, -2, 3]}, "prompt"),
    ("prompt token outside the vocabulary", {"prompt": [[1, 2], [3, VOCAB]]}, "prompt"),
    ("min_tokens above max_tokens", {**HI, "min_tokens": 5}, "min_tokens"),
    ("top_k 2**63", {**HI, "top_k": 2**63}, "top_k"),
    ("seed 2**64", {**HI, "seed": 2**64}, "seed"),
    ("seed negative", {**HI, "seed": -1}, "seed"),
    ("n huge", {**HI, "n": 10**6}, "n"),
    ("max_tokens 2**40", {"prompt": "hi", "max_tokens": 2**40}, "max_tokens"),
    ("min_tokens 2**70", {**HI, "min_tokens": 2**70}, "min_tokens"),
    ("priority 2**40", {**HI, "priority": 2**40}, "priority"),
    ("priority without the priority policy", {**HI, "priority": 3}, "priority"),
    ("logit_bias above 100", {**HI, "logit_bias": {"5": 101}}, "logit_bias.5"),
    ("logit_bias key not a token id", {**HI, "logit_bias": {"abc": 1}}, "logit_bias.abc"),
    ("logit_bias key outside the vocabulary", {**HI, "logit_bias": {str(VOCAB + 1): 1}}, "logit_bias"),
    ("unsupported field", {**HI, "tools": [{"type": "function"}]}, "tools"),
    ("unsupported stream option", {**HI, "stream": True, "stream_options": {"include_usage": True, "x": 1}},
     "stream_options.x"),
    ("integer as a string", {**HI, "max_tokens": "4"}, "max_tokens"),
    ("lone surrogate in the prompt", {"prompt": "a\ud800b"}, "prompt"),
    ("lone surrogate in a prompt list", {"prompt": ["ok", "\udfff"]}, "prompt"),
    ("lone surrogate in stop", {**HI, "stop": ["\ud800"]}, "stop"),
    ("stop string too long", {**HI, "stop": "x" * 257}, "stop"),
    ("too many stop strings", {**HI, "stop": [str(i) for i in range(17)]}, "stop"),
    ("too many prompts", {"prompt": ["a"] * 300, "max_tokens": 1}, "prompt"),
    ("max_tokens 0 without echo", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("prompt_logprobs too many", {**HI, "prompt_logprobs": 21}, "prompt_logprobs"),
    ("cache_salt empty", {**HI, "cache_salt": ""}, "cache_salt"),
    ("suffix", {**HI, "suffix": "end"}, "suffix"),
]

BAD_CHATS = [
    ("lone surrogate in a message", {"messages": [{"role": "user", "content": "\ud800"}]}, "messages.0.content"),
    ("lone surrogate in a text part", {"messages": [{"role": "user", "content": [{"type": "text", "text": "\ud800"}]}]},
     "messages.0.content"),
    ("client chat_template", {**CHAT, "chat_template": "{{ messages }}"}, "chat_template"),
    ("chat_template_kwargs outside the allow-list", {**CHAT, "chat_template_kwargs": {"tokenize": True}},
     "chat_template_kwargs.tokenize"),
    ("chat_template_kwargs add_generation_prompt", {**CHAT, "chat_template_kwargs": {"add_generation_prompt": False}},
     "chat_template_kwargs.add_generation_prompt"),
    ("chat_template_kwargs wrong value type", {**CHAT, "chat_template_kwargs": {"thinking": {"a": 1}}},
     "chat_template_kwargs.thinking"),
    ("unknown message field", {"messages": [{"role": "user", "content": "hi", "tool_calls": []}]},
     "messages.0.tool_calls"),
    ("top_k 2**63", {**CHAT, "top_k": 2**63}, "top_k"),
    ("logit_bias outside the vocabulary", {**CHAT, "logit_bias": {"99999": 1}}, "logit_bias"),
]


@pytest.fixture(scope="module")
def fake():
    with fake_server(ServerConfig(drain_timeout=1, max_request_bytes=64 * 1024)) as pair:
        yield pair


@pytest.mark.parametrize("name,payload,param", BAD_COMPLETIONS, ids=[c[0] for c in BAD_COMPLETIONS])
def test_bad_completions_are_400_and_nothing_is_queued(fake, name, payload, param):
    client, engine = fake
    before = engine.stats.prompt_tokens_total
    assert_error(post(client, "/v1/completions", payload), 400, param)
    assert engine.stats.prompt_tokens_total == before  # the engine never saw it


@pytest.mark.parametrize("name,payload,param", BAD_CHATS, ids=[c[0] for c in BAD_CHATS])
def test_bad_chats_are_400(fake, name, payload, param):
    client, _ = fake
    assert_error(post(client, "/v1/chat/completions", payload), 400, param)


def test_unsupported_field_says_so(fake):
    client, _ = fake
    err = assert_error(client.post("/v1/completions", json={**HI, "frobnicate": 1}), 400, "frobnicate")
    assert "not supported" in err["message"]


def test_non_finite_float_is_400(fake):
    client, _ = fake
    resp = client.post("/v1/completions", content='{"prompt": "hi", "temperature": NaN}',
                       headers={"Content-Type": "application/json"})
    assert_error(resp, 400)


def test_surrogates_in_tokenize_and_detokenize_are_400(fake):
    client, _ = fake
    assert_error(post(client, "/tokenize", {"prompt": "\ud800"}), 400, "prompt")
    assert_error(post(client, "/tokenize", {"messages": [{"role": "user", "content": "x\udc00"}]}), 400,
                 "messages.0.content")
    assert_error(client.post("/detokenize", json={"tokens": [1, VOCAB]}), 400, "tokens")
    assert_error(client.post("/detokenize", json={"tokens": [-1]}), 400, "tokens.0")


def test_body_size_limit_413_on_content_length_and_on_streamed_body(fake):
    client, engine = fake
    big = {"prompt": "a" * (70 * 1024), "max_tokens": 1}
    err = assert_error(client.post("/v1/completions", json=big), 413)
    assert "--max-request-bytes" in err["message"]

    def chunks():  # no Content-Length: the body arrives chunked, the limit counts what came
        for _ in range(80):
            yield b"x" * 1024

    err = assert_error(client.post("/v1/completions", content=chunks(), headers={"Content-Type": "application/json"}),
                       413)
    # a body under the limit still works, and so does the server
    assert client.post("/v1/completions", json=HI).status_code == 200


def test_logit_bias_is_applied(fake):
    client, _ = fake
    z = ord("z") + 1  # the byte tokenizer's id of "z"
    resp = client.post("/v1/completions", json={**HI, "max_tokens": 6, "logit_bias": {str(z): 100}})
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == "zzzzzz"
    resp = client.post("/v1/chat/completions", json={**CHAT, "logit_bias": {str(z): 100}})
    assert resp.json()["choices"][0]["message"]["content"] == "zzzz"


def test_cache_salt_reaches_the_engine(fake):
    client, engine = fake
    assert client.post("/v1/completions", json={**HI, "cache_salt": "tenant-a"}).status_code == 200
    assert client.post("/v1/chat/completions", json={**CHAT, "cache_salt": "tenant-b"}).status_code == 200
    assert engine.cache_salts[-2:] == ["tenant-a", "tenant-b"]


def test_prompt_logprobs_echo_and_max_tokens_0(fake):
    client, engine = fake
    ids = [72, 101, 108, 108, 112]
    expected = engine.prompt_logprobs(ids, 2)
    for max_tokens in (0, 1):
        resp = client.post("/v1/completions", json={"prompt": ids, "echo": True, "logprobs": 1,
                                                    "max_tokens": max_tokens, "temperature": 0})
        assert resp.status_code == 200, resp.text
        lp = resp.json()["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        for i in range(1, len(ids)):
            assert lp["token_logprobs"][i] == pytest.approx(expected[i][ids[i]].logprob)
            best = min(expected[i].values(), key=lambda v: v.rank)
            assert max(lp["top_logprobs"][i], key=lp["top_logprobs"][i].get) == best.decoded_token
        if max_tokens == 0:
            assert resp.json()["choices"][0]["finish_reason"] == "length"
            assert resp.json()["usage"]["completion_tokens"] == 0
    resp = client.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "prompt_logprobs": 2})
    plp = resp.json()["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    assert plp[2][str(ids[2])]["logprob"] == pytest.approx(expected[2][ids[2]].logprob)
    resp = client.post("/v1/chat/completions", json={**CHAT, "prompt_logprobs": 0})
    assert resp.json()["prompt_logprobs"][0] is None
    # streamed: the echoed prompt's logprobs come in the first event
    resp = client.post("/v1/completions", json={"prompt": ids, "echo": True, "logprobs": 1, "max_tokens": 0,
                                                "stream": True})
    events = [e for e in sse_events(resp.text) if e != "[DONE]"]
    first = events[0]["choices"][0]["logprobs"]
    assert first["token_logprobs"][1] == pytest.approx(expected[1][ids[1]].logprob)


def test_tokenization_runs_off_the_event_loop(fake):
    client, _ = fake
    threads: list[str] = []
    tok = client.app.state.server.tokenizer  # the server's own copy (the engine thread has the engine's)
    original = tok.encode
    original_template = tok.apply_chat_template

    def encode(*a, **kw):
        threads.append(threading.current_thread().name)
        return original(*a, **kw)

    def template(*a, **kw):
        threads.append(threading.current_thread().name)
        return original_template(*a, **kw)

    tok.encode, tok.apply_chat_template = encode, template
    try:
        assert client.post("/v1/completions", json=HI).status_code == 200
        assert client.post("/v1/chat/completions", json=CHAT).status_code == 200
        assert client.post("/tokenize", json={"prompt": "hi"}).status_code == 200
    finally:
        del tok.encode, tok.apply_chat_template
    assert len(threads) == 4 and all(t.startswith("tokenfab-tok") for t in threads), threads


def test_priority_is_honoured_under_the_priority_policy():
    with fake_server(scheduling_policy="priority") as (client, _):
        assert client.post("/v1/completions", json={**HI, "priority": 5}).status_code == 200
        assert client.post("/v1/completions", json={**HI, "priority": -5}).status_code == 200


def test_allowed_chat_template_kwargs_reach_the_template(fake):
    client, _ = fake
    seen = []
    tok = client.app.state.server.tokenizer
    original = tok.apply_chat_template

    def template(*a, **kw):
        seen.append({k: v for k, v in kw.items() if k in ("enable_thinking", "thinking", "reasoning_effort")})
        return original(*a, **kw)

    tok.apply_chat_template = template
    try:
        resp = client.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"enable_thinking": False,
                                                                                           "reasoning_effort": "low"}})
    finally:
        del tok.apply_chat_template
    assert resp.status_code == 200, resp.text
    assert seen == [{"enable_thinking": False, "reasoning_effort": "low"}]


def test_client_chat_template_only_when_trusted():
    with fake_server(ServerConfig(drain_timeout=1, trust_request_chat_template=True)) as (client, _):
        resp = client.post("/v1/chat/completions", json={**CHAT, "chat_template": "{{ messages }}"})
        assert resp.status_code == 200, resp.text


def _run(app, coro_fn):
    engine = app.state.server.engine
    engine.start()
    try:
        return asyncio.run(coro_fn())
    finally:
        engine.shutdown(0)


def test_every_choice_counts_against_max_waiting():
    fake = FakeEngine(step_time=0.05, max_num_seqs=1)
    app = build_app(AsyncEngine(fake), ServerConfig(max_waiting=4, drain_timeout=0))

    async def scenario():
        import httpx

        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as c:
            busy = asyncio.create_task(c.post("/v1/completions", json={"prompt": "a", "max_tokens": 40, "n": 2}))
            while app.state.server.engine.num_waiting() == 0:
                await asyncio.sleep(0.01)
            # 1 waits already: 2 prompts x n=2 = 4 more choices exceed the limit of 4
            many = await c.post("/v1/completions", json={"prompt": ["b", "c"], "n": 2, "max_tokens": 1})
            one = await c.post("/v1/completions", json={"prompt": "d", "max_tokens": 1})
            return await busy, many, one

    busy, many, one = _run(app, scenario)
    assert busy.status_code == 200
    assert_error(many, 429)
    assert one.status_code == 200


def test_a_failing_request_answers_alone_and_others_go_on():
    fake = FakeEngine(step_time=0.01)
    app = build_app(AsyncEngine(fake), ServerConfig(drain_timeout=0))
    good = {"prompt": "fine", "max_tokens": 8, "seed": 7}
    posts = [("/v1/completions", good), ("/v1/completions", {"prompt": "POISON", "max_tokens": 8}),
             ("/v1/chat/completions", {"messages": [{"role": "user", "content": "POISON"}], "stream": True}),
             ("/v1/completions", {**good, "stream": True}), ("/v1/completions", good)]
    resps = _run(app, lambda: gather_posts(app, posts))
    ok, bad, bad_stream, ok_stream, ok2 = resps
    assert ok.status_code == ok2.status_code == ok_stream.status_code == 200
    assert ok.json()["choices"][0]["text"] == ok2.json()["choices"][0]["text"]
    assert len(ok.json()["choices"][0]["text"]) == 8
    err = assert_error(bad, 500)
    assert err["code"] == "request_failed" and "poisoned" in err["message"]
    events = sse_events(bad_stream.text)
    assert events[-1] == "[DONE]" and events[-2]["error"]["code"] == "request_failed"
    assert sse_events(ok_stream.text)[-1] == "[DONE]"
    assert app.state.server.engine.error is None  # the engine lives on


def test_dead_engine_is_503_on_health_and_new_requests():
    with fake_server() as (client, engine):
        assert client.get("/health").json() == {"status": "ok"}
        engine.die_on_next_step = True
        resp = client.post("/v1/completions", json=HI)
        assert_error(resp, 503)
        err = assert_error(client.get("/health"), 503)
        assert "device is gone" in err["message"]
        assert_error(client.post("/v1/chat/completions", json=CHAT), 503)
        resp = client.post("/v1/completions", json={**HI, "stream": True})
        assert_error(resp, 503)


def test_continuous_usage_stats_counts_every_chunk(fake):
    client, _ = fake
    for url, body in (("/v1/completions", {**HI, "max_tokens": 5}),
                      ("/v1/chat/completions", {**CHAT, "max_tokens": 5})):
        resp = client.post(url, json={**body, "stream": True, "stream_options": {"include_usage": True,
                                                                                 "continuous_usage_stats": True}})
        events = [e for e in sse_events(resp.text) if e != "[DONE]"]
        running = [e["usage"]["completion_tokens"] for e in events if e["choices"]]
        assert running == sorted(running) and running[-1] == 5
        assert events[-1]["usage"]["completion_tokens"] == 5 and not events[-1]["choices"]
