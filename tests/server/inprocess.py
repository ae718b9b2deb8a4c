"""The HTTP app over the fake engine, in process (no socket, no model): fast server tests."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import httpx
from fastapi.testclient import TestClient

from tests.server.fake_engine import FakeEngine
from tokenfab.engine.core.async_engine import AsyncEngine
from tokenfab.server.app import ServerConfig, build_app


@contextlib.contextmanager
def fake_server(config: ServerConfig | None = None, **engine_kw: Any) -> Iterator[tuple[TestClient, FakeEngine]]:
    """A TestClient (lifespan run: engine thread started, drained at exit) and its fake engine."""
    fake = FakeEngine(**engine_kw)
    app = build_app(AsyncEngine(fake), config or ServerConfig(drain_timeout=1))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, fake


def assert_error(resp: httpx.Response, status: int, param: str | None = "?") -> dict[str, Any]:
    """``resp`` is ``status`` with OpenAI's error body (and ``param`` when given)."""
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    body = resp.json()
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}, body
    assert isinstance(err["message"], str) and err["message"]
    if param != "?":
        assert err["param"] == param, body
    return err


def sse_events(text: str) -> list[Any]:
    """The JSON payloads of an SSE body, with "[DONE]" kept as the string."""
    import json

    out: list[Any] = []
    for line in text.splitlines():
        if line.startswith("data: "):
            data = line[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


async def gather_posts(app: Any, posts: list[tuple[str, dict[str, Any]]], timeout: float = 60) -> list[httpx.Response]:
    """Send ``posts`` concurrently to the ASGI ``app`` (engine started by the caller)."""
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=timeout) as c:
        return list(await asyncio.gather(*(c.post(url, json=body) for url, body in posts)))


def post(client: Any, url: str, payload: Any) -> httpx.Response:
    """POST ``payload`` as ASCII JSON (``\\uXXXX`` escapes: lone surrogates travel as JSON allows)."""
    import json

    return client.post(url, content=json.dumps(payload), headers={"Content-Type": "application/json"})
