"""Failure paths: every bad input is a 400 with OpenAI's error body, the server keeps serving,
and a client that disconnects mid-stream gets its request aborted and its KV blocks freed."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.server.conftest import GREEDY_CHAT, MAX_MODEL_LEN, metric

LONG_PROMPT = "hello " * (MAX_MODEL_LEN + 50)

BAD_COMPLETIONS = [
    ("malformed json", '{"prompt": "hi", "max_tokens": 4', None),
    ("body is not an object", "[1, 2, 3]", None),
    ("missing prompt", {"max_tokens": 4}, "prompt"),
    ("max_tokens 0", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("max_tokens negative", {"prompt": "hi", "max_tokens": -3}, "max_tokens"),
    ("max_tokens wrong type", {"prompt": "hi", "max_tokens": "many"}, "max_tokens"),
    ("n 0", {"prompt": "hi", "n": 0}, "n"),
    ("temperature negative", {"prompt": "hi", "temperature": -0.5}, "temperature"),
    ("temperature wrong type", {"prompt": "hi", "temperature": "hot"}, "temperature"),
    ("top_p 0", {"prompt": "hi", "top_p": 0}, "top_p"),
    ("prompt wrong type", {"prompt": 42}, "prompt"),
    ("prompt empty", {"prompt": ""}, "prompt"),
    ("prompt token out of vocab", {"prompt": [1, 2, 10_000_000]}, "prompt"),
    ("prompt too long", {"prompt": LONG_PROMPT, "max_tokens": 1}, "prompt"),
    ("prompt + max_tokens too long", {"prompt": "hi", "max_tokens": MAX_MODEL_LEN + 1}, "max_tokens"),
    ("logprobs too many", {"prompt": "hi", "logprobs": 50}, "logprobs"),
    ("stop wrong type", {"prompt": "hi", "stop": 5}, "stop"),
    ("min_tokens above max_tokens", {"prompt": "hi", "max_tokens": 2, "min_tokens": 5}, "min_tokens"),
    ("unknown response_format", {"prompt": "hi", "response_format": {"type": "xml"}}, "response_format.type"),
    ("stream wrong type", {"prompt": "hi", "stream": "sometimes"}, "stream"),
]

BAD_CHATS = [
    ("messages missing", {"max_tokens": 4}, "messages"),
    ("messages empty", {"messages": []}, "messages"),
    ("messages not a list", {"messages": "hello"}, "messages"),
    ("bad role", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages.0.role"),
    ("image content", {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages.0.content"),
    ("top_logprobs without logprobs", {"messages": GREEDY_CHAT, "top_logprobs": 2}, "top_logprobs"),
    ("max_completion_tokens 0", {"messages": GREEDY_CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("json_schema without schema", {"messages": GREEDY_CHAT, "response_format": {"type": "json_schema"}},
     "response_format.json_schema"),
    ("invalid json schema", {"messages": GREEDY_CHAT, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "no-such-type"}}}},
     "response_format"),
]


def _check_error(r: httpx.Response, status: int, param: str | None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == "invalid_request_error" if status == 400 else err["type"]
    if param is not None:
        assert err["param"] == param, err
    return err


def _post(http: httpx.Client, path: str, payload) -> httpx.Response:
    if isinstance(payload, str):
        return http.post(path, content=payload, headers={"Content-Type": "application/json"})
    return http.post(path, json=payload)


@pytest.mark.parametrize("name,payload,param", BAD_COMPLETIONS, ids=[c[0] for c in BAD_COMPLETIONS])
def test_bad_completion_requests_are_400(served, http, name, payload, param):
    if isinstance(payload, dict):
        payload = {"model": served.model, **payload}
    _check_error(_post(http, "/v1/completions", payload), 400, param)


@pytest.mark.parametrize("name,payload,param", BAD_CHATS, ids=[c[0] for c in BAD_CHATS])
def test_bad_chat_requests_are_400(served, http, name, payload, param):
    payload = {"model": served.model, **payload}
    _check_error(_post(http, "/v1/chat/completions", payload), 400, param)


def test_unknown_model_is_400(served, http, client):
    err = _check_error(http.post("/v1/completions", json={"model": "gpt-17", "prompt": "hi"}), 400, "model")
    assert err["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="gpt-17", messages=GREEDY_CHAT)
    assert info.value.status_code == 400


def test_context_length_error_through_the_client(served, client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=served.model, prompt=LONG_PROMPT, max_tokens=1)
    assert info.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):  # streaming requests are validated before the 200
        client.completions.create(model=served.model, prompt=LONG_PROMPT, max_tokens=1, stream=True)


def test_unknown_route_and_method(http):
    r = http.get("/v1/nothing-here")
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = http.get("/v1/completions")
    assert r.status_code == 405 and "error" in r.json()


def test_server_still_serves_after_bad_input(served, client, http):
    for payload in ('{"broken', {"prompt": "x", "max_tokens": 0}, {"prompt": LONG_PROMPT}):
        assert _post(http, "/v1/completions", payload).status_code == 400
    r = client.completions.create(model=served.model, prompt="Hello", max_tokens=2)
    assert r.choices[0].text is not None and r.usage.completion_tokens >= 1
    assert http.get("/health").status_code == 200


def _wait_idle_metrics(http: httpx.Client, timeout: float = 60.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        text = http.get("/metrics").text
        idle = (metric(text, "tokenfab_num_requests_running") == 0
                and metric(text, "tokenfab_num_requests_waiting") == 0
                and metric(text, "tokenfab_kv_cache_usage_perc") == 0)
        if idle or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_disconnect_mid_stream_aborts_and_frees_kv(served, http, endpoint):
    _wait_idle_metrics(http)
    payload = {"model": served.model, "max_tokens": 500, "stream": True, "ignore_eos": True}
    if endpoint == "chat":
        payload["messages"] = GREEDY_CHAT
        path = "/v1/chat/completions"
    else:
        payload["prompt"] = "Tell me a very long story about a dragon."
        path = "/v1/completions"
    gen_before = metric(http.get("/metrics").text, "tokenfab_generation_tokens_total")
    with httpx.Client(base_url=served.url, timeout=60) as c, c.stream("POST", path, json=payload) as r:
        assert r.status_code == 200
        got = 0
        lines = r.iter_lines()  # kept referenced: dropping the iterator closes the connection
        for line in lines:
            if line.startswith("data: ") and line != "data: [DONE]":
                msg = json.loads(line[6:])
                ch = msg["choices"][0]
                if ch.get("text") or (ch.get("delta") or {}).get("content"):
                    got += 1
            if got >= 2:
                break
        # running while we hold the stream: KV blocks are in use
        time.sleep(0.3)
        assert metric(http.get("/metrics").text, "tokenfab_kv_cache_usage_perc") > 0
        assert metric(http.get("/metrics").text, "tokenfab_num_requests_running") == 1
        assert any(x.startswith("data: ") for x in (next(lines), next(lines)))
    # the connection is closed here, mid-stream
    text = _wait_idle_metrics(http)
    assert metric(text, "tokenfab_num_requests_running") == 0
    assert metric(text, "tokenfab_kv_cache_usage_perc") == 0.0
    generated = metric(text, "tokenfab_generation_tokens_total") - gen_before
    assert generated < 400, "the request kept generating after the client left"


def test_disconnect_of_non_streaming_request_aborts(served, http):
    _wait_idle_metrics(http)
    payload = {"model": served.model, "prompt": "Count to one thousand:", "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=served.url, timeout=2.0) as c:
        c.post("/v1/completions", json=payload)
    text = _wait_idle_metrics(http)
    assert metric(text, "tokenfab_kv_cache_usage_perc") == 0.0
    assert metric(text, "tokenfab_num_requests_running") == 0
