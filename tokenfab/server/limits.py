"""Request body size limit as pure ASGI middleware: 413 with OpenAI's error body.

Checked twice: on ``Content-Length`` before anything is read, and on the bytes actually received
(a chunked body, or a client that lies about its length). The body is buffered up to the limit and
replayed to the app in one message; later ``receive`` calls pass through, so the endpoints still see
the client's disconnect.
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tokenfab.server.errors import error_response

DEFAULT_MAX_REQUEST_BYTES = 8 << 20
# A client that sends its whole body before reading the answer (httpx, requests) sees the 413 only
# if the server reads the body; it is read and dropped up to this many bytes, past that the
# connection is closed under it.
DRAIN_LIMIT_BYTES = 64 << 20


class BodySizeLimitMiddleware:
    def __init__(self, app: ASGIApp, max_bytes: int, on_reject: Callable[[int], None] | None = None,
                 exempt: tuple[str, ...] = ()) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self._on_reject = on_reject
        self.exempt = exempt  # paths that stream their body and check their own limit (file uploads)

    async def _reject(self, scope: Scope, receive: Receive, send: Send, detail: str, received: int,
                      more_body: bool) -> None:
        while more_body and received <= DRAIN_LIMIT_BYTES:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client is gone: no one to answer
            received += len(message.get("body", b""))
            more_body = message.get("more_body", False)
        if self._on_reject:
            self._on_reject(413)
        resp = error_response(413, f"The request body is too large ({detail}); this server accepts at most "
                              f"{self.max_bytes} bytes (--max-request-bytes)", code="request_too_large",
                              headers={"Connection": "close"})
        await resp(scope, receive, send)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.exempt:
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers") or []).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = -1
            if declared > self.max_bytes:
                await self._reject(scope, receive, send, f"Content-Length {declared}", 0,
                                   more_body=declared <= DRAIN_LIMIT_BYTES)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left while sending
                await self.app(scope, _replay([message], receive), send)
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._reject(scope, receive, send, f"more than {self.max_bytes} bytes received", size,
                                   more_body=message.get("more_body", False))
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        first: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([first], receive), send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replay() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replay
