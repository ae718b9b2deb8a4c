"""OpenAI-style errors: the ``APIError`` exception, the error body, and the app's exception handlers.

Every error the server answers is OpenAI's body ``{"error": {"message", "type", "param", "code"}}``;
FastAPI's validation errors (422) and malformed JSON become 400s with the offending field as ``param``.
Every 503 (a dead or restarting engine, a draining server) carries ``Retry-After``: it is the one retryable
answer a client or a router gets while an instance is down, and the header is how either knows to retry.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("tokenfab.server")

_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "server_error",
}
RETRY_AFTER_S = 5  # seconds a client is asked to wait before retrying a 503 (another replica, or this one restarted)


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(status, "invalid_request_error")


def _safe(text: str | None) -> str | None:
    # a message or param may quote the client's input, which can hold lone surrogates: escape them
    return text.encode("utf-8", "backslashreplace").decode("utf-8") if text is not None else None


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               type: str | None = None) -> dict[str, Any]:
    message, param = _safe(message) or "", _safe(param)
    return {"error": {"message": message, "type": type or _ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   type: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    if status == 503 and not any(k.lower() == "retry-after" for k in headers or {}):
        headers = {**(headers or {}), "Retry-After": str(RETRY_AFTER_S)}
    return JSONResponse(error_body(status, message, param, code, type), status_code=status, headers=headers)


def _loc(error: dict[str, Any]) -> str:
    # drop "body" and pydantic's union-branch markers such as 'str' / 'list[int]'
    loc = [str(x) for x in error.get("loc", ()) if x != "body"]
    return ".".join(x for x in loc if "[" not in x and x not in {"str", "int", "float", "bool"})


def validation_message(exc: RequestValidationError) -> tuple[str, str | None, str | None]:
    """(message, param, code) of a request that failed pydantic validation."""
    errors = list(exc.errors())
    if not errors:
        return "invalid request", None, None
    first = errors[0]
    if first.get("type") == "json_invalid":
        ctx = first.get("ctx") or {}
        detail = ctx.get("error", first.get("msg", ""))
        return f"We could not parse the JSON body of your request: {detail}", None, "invalid_json"
    if first.get("type") == "model_attributes_type":
        return "The request body must be a JSON object", None, None
    groups: dict[str, list[dict[str, Any]]] = {}
    for e in errors:
        groups.setdefault(_loc(e), []).append(e)
    parts = []
    for where, errs in list(groups.items())[:5]:
        e = errs[0]
        if e.get("type") == "missing":
            msg = "field required"
        elif e.get("type") == "extra_forbidden":
            msg = "this field is not supported by this server"
        else:
            msg = str(e.get("msg", "invalid value"))
        if len(errs) > 1:  # a union field: none of the alternatives matched
            msg = f"invalid type or value: {msg[:1].lower() + msg[1:]} (or {len(errs) - 1} other forms)"
        parts.append(f"{where}: {msg}" if where else msg)
    param = next(iter(groups)) or None
    return "; ".join(parts), param, None


_PARAMS = ("prompt_logprobs", "stop_token_ids", "logit_bias", "cache_salt", "priority", "max_tokens", "min_tokens",
           "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty",
           "logprobs", "n", "seed", "stop")


def param_of(message: str) -> str | None:
    """The parameter an engine/SamplingParams message is about (it names it first)."""
    for name in _PARAMS:
        if message.startswith(name + " ") or message.startswith(name + ":"):
            return name
    for name in _PARAMS:
        if f" {name} " in message:
            return name
    if "prompt" in message:
        return "prompt"
    return None


def install_exception_handlers(app: FastAPI, on_error: Callable[[int], None]) -> None:
    """Answer every exception with OpenAI's error body; ``on_error(status)`` counts it."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        on_error(exc.status)
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.type)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        on_error(400)
        message, param, code = validation_message(exc)
        return error_response(400, message, param, code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        on_error(exc.status_code)
        message = str(exc.detail) if exc.detail else "error"
        if exc.status_code == 404:
            message = f"Unknown route {request.method} {request.url.path}"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        on_error(500)
        return error_response(500, f"internal server error: {type(exc).__name__}")
