"""Every 503 says when to retry (``Retry-After``): a dead engine (a killed engine core, a device error) answers 503
on /health, on the deep health check and on every generation route, and a client or a router behind it can only
tell a retryable answer from a failure by that status and header (issue 28, chaos)."""

from __future__ import annotations

from tests.server.inprocess import assert_error, fake_server
from tokenfab.server.errors import RETRY_AFTER_S, error_response

HI = {"model": "fake-model", "prompt": "hi", "max_tokens": 4}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


def test_a_503_carries_retry_after_and_other_errors_do_not():
    assert error_response(503, "down").headers["retry-after"] == str(RETRY_AFTER_S)
    assert error_response(503, "down", headers={"Retry-After": "30"}).headers["retry-after"] == "30"
    assert "retry-after" not in error_response(500, "boom").headers
    assert "retry-after" not in error_response(400, "bad").headers


def test_a_dead_engine_answers_503_with_retry_after_everywhere():
    with fake_server() as (client, engine):
        ok = client.post("/v1/completions", json=HI)
        assert ok.status_code == 200 and "retry-after" not in ok.headers
        engine.die_on_next_step = True
        answers = [client.post("/v1/completions", json=HI), client.get("/health"),
                   client.post("/v1/chat/completions", json=CHAT),
                   client.post("/v1/completions", json={**HI, "stream": True}),
                   client.post("/v1/chat/completions", json={**CHAT, "stream": True}),
                   client.get("/health_generate")]
        for resp in answers:
            assert_error(resp, 503)
            assert int(resp.headers["retry-after"]) == RETRY_AFTER_S, resp.request.url
