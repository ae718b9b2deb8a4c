"""API-key check as pure ASGI middleware (it does not wrap ``receive``, so streaming and
disconnect detection stay intact)."""

from __future__ import annotations

import secrets
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from tokenfab.server.errors import error_response


class AuthMiddleware:
    """401 with an OpenAI error body unless ``Authorization: Bearer <api_key>`` is sent."""

    PROTECTED = ("/v1/", "/tokenize", "/detokenize")

    def __init__(self, app: ASGIApp, api_key: str, on_reject: Callable[[int], None] | None = None) -> None:
        self.app = app
        self._expected = f"Bearer {api_key}".encode()
        self._on_reject = on_reject

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope.get("method") != "OPTIONS":
            path = scope.get("path", "")
            if path.startswith(self.PROTECTED):
                got = dict(scope.get("headers") or []).get(b"authorization", b"")
                if not secrets.compare_digest(got, self._expected):
                    if self._on_reject:
                        self._on_reject(401)
                    resp = error_response(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'",
                                          code="invalid_api_key",
                                          headers={"WWW-Authenticate": "Bearer"})
                    await resp(scope, receive, send)
                    return
        await self.app(scope, receive, send)
