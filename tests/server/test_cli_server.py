"""`tokenfab serve` as a real process: the start-up banner, --api-key (401), --max-waiting (429),
and SIGTERM draining the running requests before exiting. The tests run in file order: the
SIGTERM test stops the server and comes last."""

from __future__ import annotations

import os
import re
import signal
import socket
import sys
import time

import httpx
import openai
import pytest

from tests.server.streams import data_events, first_token, interrupt_stream
from tests.watched_process import WatchedProcess

API_KEY = "test-key-123"


class ServeProcess(WatchedProcess):
    """``tokenfab serve --port 0 ARGS``, ready (its banner out) when constructed; ``wait=False``: started only,
    ``ready()`` waits for it (servers started together load their models at the same time)."""

    def __init__(self, *args: str, wait: bool = True) -> None:
        env = {**os.environ, "TOKENFAB_API_KEY": API_KEY, "PYTHONUNBUFFERED": "1"}
        super().__init__([sys.executable, "-m", "tokenfab", "serve", "--port", "0", *args], env)
        self.url = ""
        self.connectable_at_banner = False
        if wait:
            self.ready()

    def ready(self) -> ServeProcess:
        """Wait for the banner; the URL is then known."""
        if self.url:
            return self
        self.url = self.wait_for(r"serving .* at (http://\S+)/v1", 180).group(1)
        self.wait_for(r"curl ", 10)
        # the port must take connections as soon as the banner is out (they may wait, not be refused)
        host, port = self.url.removeprefix("http://").rsplit(":", 1)
        try:
            socket.create_connection((host, int(port)), timeout=5).close()
            self.connectable_at_banner = True
        except OSError:
            self.connectable_at_banner = False
        return self

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture(scope="module")
def cli_server():
    # 128 KV blocks (2,048 tokens; a request here needs at most 20): allocated at once, not the default's gigabytes
    server = ServeProcess("--max-num-seqs", "1", "--max-waiting", "1", "--max-model-len", "512",
                          "--num-kv-blocks", "128", "--no-access-log", "--drain-timeout", "60",
                          "--max-request-bytes", "65536", "--max-prompts-per-request", "2")
    yield server
    server.stop()


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {API_KEY}"}


def test_banner_names_url_model_kv_and_curl(cli_server):
    out = cli_server.output
    assert cli_server.url.startswith("http://127.0.0.1:")
    assert cli_server.connectable_at_banner
    assert "SmolLM2-135M-Instruct" in out
    m = re.search(r"KV cache: ([\d,]+) tokens", out)
    assert m and int(m.group(1).replace(",", "")) > 0
    assert f"curl {cli_server.url}/v1/chat/completions" in out
    assert "Authorization: Bearer $TOKENFAB_API_KEY" in out
    assert API_KEY not in out  # the key itself is never printed


def test_api_key_required(cli_server):
    url = cli_server.url
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}):
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 1}, headers=headers)
        assert r.status_code == 401
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["code"] == "invalid_api_key"
    assert httpx.get(f"{url}/v1/models").status_code == 401
    # health and metrics stay open (probes, scrapers)
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/metrics").status_code == 200
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{url}/v1", api_key="nope", max_retries=0).models.list()
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hello", max_tokens=2)
    assert r.usage.completion_tokens >= 1


def test_request_limits_flags(cli_server):
    url, headers = cli_server.url, _auth()
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "x" * 70_000, "max_tokens": 1}, headers=headers)
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": ["a", "b", "c"], "max_tokens": 1}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = httpx.post(f"{url}/v1/completions", json={"prompt": "a", "max_tokens": 1, "priority": 1}, headers=headers)
    assert r.status_code == 400 and r.json()["error"]["param"] == "priority"  # fcfs: priority refused
    r = httpx.post(f"{url}/v1/chat/completions", headers=headers, json={
        "messages": [{"role": "user", "content": "a"}], "max_tokens": 1, "chat_template": "{{ 1 }}"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
    # two prompts are two choices: over --max-waiting 1 even with nothing else waiting
    r = httpx.post(f"{url}/v1/completions", json={"prompt": ["a", "b"], "max_tokens": 1}, headers=headers)
    assert r.status_code == 429, r.text
    r = httpx.post(f"{url}/v1/completions", json={"prompt": ["a"], "max_tokens": 1}, headers=headers)
    assert r.status_code == 200, r.text


def test_queue_full_is_429_at_once(cli_server):
    url = cli_server.url
    long = {"prompt": "Write a long essay about rivers.", "max_tokens": 300, "stream": True, "ignore_eos": True}
    with httpx.Client(base_url=url, headers=_auth(), timeout=120) as c1, \
            httpx.Client(base_url=url, headers=_auth(), timeout=120) as c2:
        # one request runs (--max-num-seqs 1) ...
        with c1.stream("POST", "/v1/completions", json=long) as running:
            assert running.status_code == 200
            # keep the line iterator referenced: dropping it closes the connection (= disconnect)
            running_lines = running.iter_lines()
            first_token(running_lines)
            # ... one waits (--max-waiting 1) ...
            with c2.stream("POST", "/v1/completions", json=long) as waiting:
                assert waiting.status_code == 200
                # ... and the next is turned away at once
                t0 = time.monotonic()
                r = httpx.post(f"{url}/v1/completions", headers=_auth(), json={"prompt": "hi", "max_tokens": 2})
                assert time.monotonic() - t0 < 5
                assert r.status_code == 429, r.text
                err = r.json()["error"]
                assert err["code"] == "rate_limit_exceeded" and "waiting" in err["message"]
                client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
                with pytest.raises(openai.RateLimitError):
                    client.chat.completions.create(model="SmolLM2-135M-Instruct",
                                                   messages=[{"role": "user", "content": "hi"}], max_tokens=2)
                assert any(x.startswith("data: ") for x in (next(running_lines), next(running_lines)))  # still alive
    # both streams were dropped: the server frees them and serves again
    client = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0, timeout=120)
    deadline = time.monotonic() + 60
    while True:
        try:
            r = client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=2)
            break
        except openai.RateLimitError:
            assert time.monotonic() < deadline
            time.sleep(0.2)
    assert r.usage.completion_tokens >= 1


def test_sigterm_drains_running_requests_then_exits(cli_server):
    url = cli_server.url
    payload = {"prompt": "Count slowly:", "max_tokens": 12, "stream": True, "ignore_eos": True,
               "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=url, headers=_auth(), timeout=120) as c:
        rest, _, _ = interrupt_stream(c, payload, lambda: cli_server.proc.send_signal(signal.SIGTERM))
    events = data_events(rest)
    finishes = [e["choices"][0]["finish_reason"] for e in events if e["choices"]]
    assert finishes[-1] == "length"
    assert events[-1]["usage"]["completion_tokens"] == 12
    assert rest[-1] == "data: [DONE]" or "data: [DONE]" in rest
    # uvicorn re-raises the captured SIGTERM once it has shut down cleanly
    assert cli_server.proc.wait(60) in (0, -signal.SIGTERM)
    assert "Finished server process" in cli_server.output or "Shutting down" in cli_server.output
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health")
