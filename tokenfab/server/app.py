"""The OpenAI-compatible HTTP API over an ``AsyncEngine`` (FastAPI).

Routes: /v1/completions, /v1/chat/completions, /v1/models, /health, /metrics, /tokenize,
/detokenize. Every error is OpenAI's body ``{"error": {"message", "type", "param", "code"}}``;
bad input is a 400 (FastAPI's 422 for validation errors and malformed JSON included).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from tokenfab.engine.async_engine import (
    AsyncEngine,
    EngineDeadError,
    QueueFullError,
    RequestStream,
    StreamChunk,
)
from tokenfab.engine.outputs import Logprob
from tokenfab.engine.sampling_params import SamplingParams
from tokenfab.server.metrics import ServerMetrics
from tokenfab.server.protocol import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
    random_id,
)

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


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(status, "invalid_request_error")


def error_body(status: int, message: str, param: str | None = None, code: str | None = None,
               type: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type or _ERROR_TYPES.get(status, "server_error"),
                      "param": param, "code": code}}


def error_response(status: int, message: str, param: str | None = None, code: str | None = None,
                   type: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param, code, type), status_code=status, headers=headers)


@dataclass
class ServerConfig:
    api_key: str | None = None
    max_waiting: int | None = None
    drain_timeout: float = 30.0


class _AuthMiddleware:
    """Pure ASGI middleware (does not wrap `receive`, so streaming and disconnects stay intact)."""

    PROTECTED = ("/v1/", "/tokenize", "/detokenize")

    def __init__(self, app: ASGIApp, api_key: str, on_reject: Any = None) -> None:
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


class _ClientGone(Exception):
    pass


class _EngineStreamingResponse(StreamingResponse):
    """SSE response that aborts its engine request however the response ends (even when the
    client is gone before the body generator ever started)."""

    def __init__(self, content: AsyncIterator[str], stream: RequestStream) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._engine_stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._engine_stream.abort()


# ---- helpers ----------------------------------------------------------------------------------


def _sse(payload: dict[str, Any] | str) -> str:
    data = payload if isinstance(payload, str) else json.dumps(payload, ensure_ascii=False)
    return f"data: {data}\n\n"


def _loc(error: dict[str, Any]) -> str:
    # drop "body" and pydantic's union-branch markers such as 'str' / 'list[int]'
    loc = [str(x) for x in error.get("loc", ()) if x != "body"]
    return ".".join(x for x in loc if "[" not in x and x not in {"str", "int", "float", "bool"})


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None, str | None]:
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
        msg = "field required" if e.get("type") == "missing" else str(e.get("msg", "invalid value"))
        if len(errs) > 1:  # a union field: none of the alternatives matched
            msg = f"invalid type or value: {msg[:1].lower() + msg[1:]} (or {len(errs) - 1} other forms)"
        parts.append(f"{where}: {msg}" if where else msg)
    param = next(iter(groups)) or None
    return "; ".join(parts), param, None


def _token_str(lp: dict[int, Logprob], tok: int, tokenizer: Any) -> str:
    entry = lp.get(tok)
    if entry is not None:
        return entry.decoded_token
    return tokenizer.decode([tok])


def _top(lp: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    return sorted(((t, v) for t, v in lp.items() if v.rank <= k), key=lambda x: x[1].rank)[:k]


def _finite(x: float) -> float:
    # JSON has no -inf: report a very negative number instead
    return x if x > -1e30 else -9999.0


class OpenAIServer:
    def __init__(self, engine: AsyncEngine, config: ServerConfig | None = None) -> None:
        self.engine = engine
        self.config = config or ServerConfig()
        if self.config.max_waiting is not None:
            engine.max_waiting = self.config.max_waiting
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.metrics = ServerMetrics(self.model_name, stats=engine.stats, waiting=engine.num_waiting)
        engine.on_first_token = self.metrics.on_first_token
        engine.on_finished = self.metrics.on_finished
        self._structured: Any = None
        self._structured_lock = asyncio.Lock()
        self._created = int(time.time())

    # ---- validation and request building ----
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(400, f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    def render_chat(self, messages: list[ChatMessage], add_generation_prompt: bool = True,
                    continue_final_message: bool = False, kwargs: dict[str, Any] | None = None) -> str:
        conv = []
        for i, m in enumerate(messages):
            content = m.content
            if isinstance(content, list):
                texts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise APIError(400, f"messages[{i}].content: only text parts are supported",
                                       param=f"messages.{i}.content")
                    texts.append(part["text"])
                content = "\n".join(texts)
            role = "system" if m.role == "developer" else m.role
            msg: dict[str, Any] = {"role": role, "content": content or ""}
            if m.name:
                msg["name"] = m.name
            conv.append(msg)
        if continue_final_message:
            add_generation_prompt = False
        try:
            return self.tokenizer.apply_chat_template(
                conv, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, **(kwargs or {}),
            )
        except Exception as e:  # jinja errors: role order, bad kwargs
            raise APIError(400, f"could not apply the chat template: {e}", param="messages") from e

    def check_length(self, num_prompt: int, max_tokens: int | None, explicit: bool, param: str) -> int | None:
        if num_prompt == 0:
            raise APIError(400, "The prompt is empty", param=param)
        if num_prompt >= self.max_model_len:
            raise APIError(
                400, f"This model's maximum context length is {self.max_model_len} tokens, but the prompt has "
                f"{num_prompt} tokens (at least one must be left to generate). Please shorten the prompt.",
                param=param, code="context_length_exceeded")
        room = self.max_model_len - num_prompt
        if max_tokens is None:
            return None
        if max_tokens > room:
            if not explicit:
                return room
            raise APIError(
                400, f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                f"requested {num_prompt + max_tokens} tokens ({num_prompt} in the prompt, {max_tokens} for "
                "the completion). Please reduce the length of the prompt or completion.",
                param="max_tokens", code="context_length_exceeded")
        return max_tokens

    async def build_constraint(self, response_format: Any) -> Any:
        if response_format is None or response_format.type == "text":
            return None
        from tokenfab.engine.structured import StructuredOutputCompiler, StructuredOutputError

        if response_format.type == "json_schema" and (response_format.json_schema is None
                                                      or response_format.json_schema.json_schema is None):
            raise APIError(400, "response_format.json_schema.schema is required",
                           param="response_format.json_schema")
        async with self._structured_lock:
            if self._structured is None:
                vocab = getattr(self.engine.engine, "vocab_size", None)
                try:
                    self._structured = await asyncio.to_thread(StructuredOutputCompiler, self.tokenizer, vocab)
                except Exception as e:
                    logger.exception("cannot set up structured output")
                    raise APIError(400, f"response_format is not available with this model's tokenizer: {e}",
                                   param="response_format") from e
        rf = response_format.model_dump(by_alias=True, exclude_none=True)
        try:
            return await asyncio.to_thread(self._structured.from_response_format, rf)
        except StructuredOutputError as e:
            raise APIError(400, str(e), param="response_format") from e

    def sampling_params(self, body: Any, max_tokens: int | None, logprobs: int | None,
                        constraint: Any) -> SamplingParams:
        try:
            return SamplingParams(
                n=body.n,
                temperature=1.0 if body.temperature is None else body.temperature,
                top_p=1.0 if body.top_p is None else body.top_p,
                top_k=body.top_k or 0,
                min_p=body.min_p or 0.0,
                seed=body.seed,
                presence_penalty=body.presence_penalty,
                frequency_penalty=body.frequency_penalty,
                repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
                max_tokens=max_tokens,
                min_tokens=body.min_tokens,
                stop=body.stop,
                stop_token_ids=body.stop_token_ids,
                ignore_eos=body.ignore_eos,
                logprobs=logprobs,
                skip_special_tokens=body.skip_special_tokens,
                include_stop_str_in_output=body.include_stop_str_in_output,
                constraint=constraint,
            )
        except ValueError as e:
            raise APIError(400, str(e), param=_param_of(str(e))) from e

    async def submit(self, prompts: list[list[int]], params: SamplingParams, priority: int,
                     arrival: float, request_id: str) -> RequestStream:
        try:
            stream = self.engine.add_requests(request_id, prompts, params, priority, arrival_time=arrival)
        except QueueFullError as e:
            raise APIError(429, str(e), code="rate_limit_exceeded", type="rate_limit_error") from e
        except EngineDeadError as e:
            raise APIError(503, str(e), code="service_unavailable") from e
        except ValueError as e:
            raise APIError(400, str(e)) from e
        try:
            await stream.wait_accepted()
        except ValueError as e:
            raise APIError(400, str(e), param=_param_of(str(e))) from e
        except EngineDeadError as e:
            raise APIError(503, str(e), code="service_unavailable") from e
        except asyncio.CancelledError:
            stream.abort()
            raise
        return stream

    # ---- /v1/completions ----
    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(body.model)
        if body.suffix:
            raise APIError(400, "suffix is not supported", param="suffix")
        if body.best_of is not None and body.best_of != body.n:
            raise APIError(400, "best_of is not supported (use n)", param="best_of")
        raw = body.prompt
        if isinstance(raw, str):
            raw_prompts: list[Any] = [raw]
        elif raw and all(isinstance(x, int) for x in raw):
            raw_prompts = [raw]
        else:
            raw_prompts = list(raw)
        if not raw_prompts:
            raise APIError(400, "The prompt is empty", param="prompt")
        prompt_ids: list[list[int]] = []
        prompt_texts: list[str] = []
        vocab = int(getattr(self.engine.engine, "vocab_size", 0) or 0)
        for p in raw_prompts:
            if isinstance(p, str):
                prompt_ids.append(self.tokenize(p))
                prompt_texts.append(p)
            else:
                ids = [int(t) for t in p]
                if vocab and any(t < 0 or t >= vocab for t in ids):
                    raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
                prompt_ids.append(ids)
                prompt_texts.append(self.tokenizer.decode(ids) if body.echo else "")
        explicit = body.max_tokens is not None
        max_tokens_list = [self.check_length(len(ids), body.max_tokens if explicit else 16, explicit, "prompt")
                           for ids in prompt_ids]
        max_tokens = min((m for m in max_tokens_list if m is not None), default=None)
        constraint = await self.build_constraint(body.response_format)
        params = self.sampling_params(body, max_tokens, body.logprobs, constraint)
        request_id = random_id("cmpl")
        stream = await self.submit(prompt_ids, params, body.priority, arrival, request_id)
        created = int(time.time())
        if body.stream:
            gen = self._completion_stream(body, request, stream, request_id, created, prompt_ids, prompt_texts)
            return _EngineStreamingResponse(gen, stream)
        finals = await self._collect(stream, request)
        choices = []
        completion_tokens = 0
        for index in range(stream.num_choices):
            chunks = finals[index]
            last = chunks[-1]
            p_idx = last.prompt_index
            text = last.text or ""
            token_ids = last.token_ids or []
            completion_tokens += len(token_ids)
            logprobs = None
            if body.logprobs is not None:
                lps = [lp for c in chunks for lp in (c.delta_logprobs or [])]
                gen_ids = [t for c in chunks for t in c.delta_token_ids]
                logprobs = self._completion_logprobs(gen_ids, lps, body.logprobs,
                                                     prompt_ids[p_idx] if body.echo else None,
                                                     len(prompt_texts[p_idx]) if body.echo else 0)
            if body.echo:
                text = prompt_texts[p_idx] + text
            choices.append({"index": index, "text": text, "logprobs": logprobs,
                            "finish_reason": _finish(last.finish_reason), "stop_reason": last.stop_reason})
        prompt_tokens = sum(len(ids) for ids in prompt_ids)
        return JSONResponse({
            "id": request_id, "object": "text_completion", "created": created, "model": self.model_name,
            "choices": choices, "usage": self._usage(prompt_tokens, completion_tokens, finals),
            "system_fingerprint": None,
        })

    def _usage(self, prompt_tokens: int, completion_tokens: int,
               finals: dict[int, list[StreamChunk]] | None = None) -> dict[str, Any]:
        usage: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                 "total_tokens": prompt_tokens + completion_tokens}
        if finals:
            cached = {}
            for chunks in finals.values():
                if chunks:
                    cached[chunks[-1].prompt_index] = chunks[-1].num_cached_tokens
            usage["prompt_tokens_details"] = {"cached_tokens": sum(cached.values())}
        return usage

    def _completion_logprobs(self, token_ids: list[int], lps: list[dict[int, Logprob]], k: int,
                             echo_ids: list[int] | None, offset: int) -> dict[str, Any]:
        out: dict[str, Any] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        pos = 0
        if echo_ids:
            # The engine does not compute prompt logprobs: the echoed prompt tokens carry null.
            for t in echo_ids:
                s = self.tokenizer.decode([t])
                out["tokens"].append(s)
                out["token_logprobs"].append(None)
                out["top_logprobs"].append(None)
                out["text_offset"].append(pos)
                pos += len(s)
            pos = offset
        for tok, lp in zip(token_ids, lps):
            s = _token_str(lp, tok, self.tokenizer)
            entry = lp.get(tok)
            out["tokens"].append(s)
            out["token_logprobs"].append(_finite(entry.logprob) if entry is not None else None)
            out["top_logprobs"].append({v.decoded_token: _finite(v.logprob) for _, v in _top(lp, k)})
            out["text_offset"].append(pos)
            pos += len(s)
        return out

    async def _completion_stream(self, body: CompletionRequest, request: Request, stream: RequestStream,
                                 request_id: str, created: int, prompt_ids: list[list[int]],
                                 prompt_texts: list[str]) -> AsyncIterator[str]:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        offsets = [0] * stream.num_choices
        started = [False] * stream.num_choices
        completion_tokens = 0
        finals: dict[int, list[StreamChunk]] = {}
        base = {"id": request_id, "object": "text_completion", "created": created, "model": self.model_name}
        watcher = self._watch(stream, request)
        try:
            async for chunk in stream:
                i = chunk.index
                text = chunk.delta_text
                logprobs = None
                if body.echo and not started[i]:
                    started[i] = True
                    text = prompt_texts[chunk.prompt_index] + text
                if body.logprobs is not None and chunk.delta_token_ids:
                    echo = prompt_ids[chunk.prompt_index] if (body.echo and offsets[i] == 0) else None
                    logprobs = self._completion_logprobs(
                        chunk.delta_token_ids, chunk.delta_logprobs or [], body.logprobs, echo,
                        offsets[i] or (len(prompt_texts[chunk.prompt_index]) if body.echo else 0))
                    if logprobs["text_offset"]:
                        offsets[i] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
                completion_tokens += len(chunk.delta_token_ids)
                if chunk.finished:
                    finals[i] = [chunk]
                if not (text or chunk.finished or logprobs):
                    continue
                payload = dict(base)
                payload["choices"] = [{"index": i, "text": text, "logprobs": logprobs,
                                       "finish_reason": _finish(chunk.finish_reason),
                                       "stop_reason": chunk.stop_reason}]
                if include_usage:
                    payload["usage"] = None
                yield _sse(payload)
            if include_usage:
                prompt_tokens = sum(len(ids) for ids in prompt_ids)
                payload = dict(base)
                payload["choices"] = []
                payload["usage"] = self._usage(prompt_tokens, completion_tokens, finals)
                yield _sse(payload)
        except _ClientGone:
            return
        except Exception as e:  # engine failure mid-stream: report it in-band
            logger.exception("stream %s failed", request_id)
            yield _sse(error_body(500, f"generation failed: {e}"))
        finally:
            watcher.cancel()
            stream.abort()
        yield _sse("[DONE]")

    # ---- /v1/chat/completions ----
    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        self.check_model(body.model)
        text = self.render_chat(body.messages, body.add_generation_prompt, body.continue_final_message,
                                body.chat_template_kwargs)
        ids = self.tokenize(text, add_special_tokens=False)
        explicit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        max_tokens = self.check_length(len(ids), explicit, explicit is not None, "messages")
        if body.top_logprobs is not None and not body.logprobs and body.top_logprobs > 0:
            raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
        k = (body.top_logprobs or 0) if body.logprobs else None
        constraint = await self.build_constraint(body.response_format)
        params = self.sampling_params(body, max_tokens, k, constraint)
        request_id = random_id("chatcmpl")
        stream = await self.submit([ids], params, body.priority, arrival, request_id)
        created = int(time.time())
        if body.stream:
            gen = self._chat_stream(body, request, stream, request_id, created, len(ids), k)
            return _EngineStreamingResponse(gen, stream)
        finals = await self._collect(stream, request)
        choices = []
        completion_tokens = 0
        for index in range(stream.num_choices):
            chunks = finals[index]
            last = chunks[-1]
            token_ids = last.token_ids or []
            completion_tokens += len(token_ids)
            logprobs = None
            if k is not None:
                lps = [lp for c in chunks for lp in (c.delta_logprobs or [])]
                gen_ids = [t for c in chunks for t in c.delta_token_ids]
                logprobs = {"content": self._chat_logprobs(gen_ids, lps, k)}
            choices.append({"index": index, "message": {"role": "assistant", "content": last.text or ""},
                            "logprobs": logprobs, "finish_reason": _finish(last.finish_reason),
                            "stop_reason": last.stop_reason})
        return JSONResponse({
            "id": request_id, "object": "chat.completion", "created": created, "model": self.model_name,
            "choices": choices, "usage": self._usage(len(ids), completion_tokens, finals),
            "system_fingerprint": None,
        })

    def _chat_logprobs(self, token_ids: list[int], lps: list[dict[int, Logprob]], k: int) -> list[dict]:
        content = []
        for tok, lp in zip(token_ids, lps):
            s = _token_str(lp, tok, self.tokenizer)
            entry = lp.get(tok)
            content.append({
                "token": s, "logprob": _finite(entry.logprob) if entry is not None else -9999.0,
                "bytes": list(s.encode("utf-8")),
                "top_logprobs": [{"token": v.decoded_token, "logprob": _finite(v.logprob),
                                  "bytes": list(v.decoded_token.encode("utf-8"))} for _, v in _top(lp, k)],
            })
        return content

    async def _chat_stream(self, body: ChatCompletionRequest, request: Request, stream: RequestStream,
                           request_id: str, created: int, num_prompt: int, k: int | None) -> AsyncIterator[str]:
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        base = {"id": request_id, "object": "chat.completion.chunk", "created": created,
                "model": self.model_name}
        completion_tokens = 0
        finals: dict[int, list[StreamChunk]] = {}

        def payload(choice: dict[str, Any]) -> str:
            p = dict(base)
            p["choices"] = [choice]
            if include_usage:
                p["usage"] = None
            return _sse(p)

        watcher = self._watch(stream, request)
        try:
            for i in range(stream.num_choices):
                yield payload({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                               "finish_reason": None})
            async for chunk in stream:
                completion_tokens += len(chunk.delta_token_ids)
                logprobs = None
                if k is not None and chunk.delta_token_ids:
                    logprobs = {"content": self._chat_logprobs(chunk.delta_token_ids,
                                                               chunk.delta_logprobs or [], k)}
                if chunk.finished:
                    finals[chunk.index] = [chunk]
                if not (chunk.delta_text or chunk.finished or logprobs):
                    continue
                delta = {"content": chunk.delta_text} if chunk.delta_text else {}
                yield payload({"index": chunk.index, "delta": delta, "logprobs": logprobs,
                               "finish_reason": _finish(chunk.finish_reason), "stop_reason": chunk.stop_reason})
            if include_usage:
                p = dict(base)
                p["choices"] = []
                p["usage"] = self._usage(num_prompt, completion_tokens, finals)
                yield _sse(p)
        except _ClientGone:
            return
        except Exception as e:
            logger.exception("stream %s failed", request_id)
            yield _sse(error_body(500, f"generation failed: {e}"))
        finally:
            watcher.cancel()
            stream.abort()
        yield _sse("[DONE]")

    # ---- stream consumption with disconnect detection ----
    def _watch(self, stream: RequestStream, request: Request) -> asyncio.Task:
        """A task that aborts ``stream`` as soon as the client disconnects (cancel it when done)."""
        return asyncio.create_task(self._watch_disconnect(stream, request))

    async def _watch_disconnect(self, stream: RequestStream, request: Request) -> None:
        with contextlib.suppress(Exception, asyncio.CancelledError):
            while not stream.finished:
                message = await request.receive()
                if message.get("type") == "http.disconnect":
                    if not stream.finished:
                        logger.info("client disconnected: aborting %s", stream.request_id)
                        stream.abort(_ClientGone())
                    return

    async def _collect(self, stream: RequestStream, request: Request) -> dict[int, list[StreamChunk]]:
        by_index: dict[int, list[StreamChunk]] = {i: [] for i in range(stream.num_choices)}
        watcher = self._watch(stream, request)
        try:
            async for chunk in stream:
                by_index[chunk.index].append(chunk)
        except _ClientGone as e:
            raise APIError(499, "client disconnected") from e
        except EngineDeadError as e:
            raise APIError(503, str(e), code="service_unavailable") from e
        except ValueError as e:
            raise APIError(400, str(e)) from e
        finally:
            watcher.cancel()
            stream.abort()
        return by_index

    # ---- tokenizer endpoints ----
    async def tokenize_endpoint(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        if body.messages is not None:
            text = self.render_chat(body.messages, body.add_generation_prompt)
            ids = self.tokenize(text, add_special_tokens=False)
        elif body.prompt is not None:
            ids = self.tokenize(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise APIError(400, "either 'prompt' or 'messages' is required", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    async def detokenize_endpoint(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        vocab = int(getattr(self.engine.engine, "vocab_size", 0) or len(self.tokenizer))
        if any(t < 0 or t >= vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    def models(self) -> dict[str, Any]:
        card = ModelCard(id=self.model_name, created=self._created, max_model_len=self.max_model_len)
        return ModelList(data=[card]).model_dump()


def _finish(reason: str | None) -> str | None:
    if reason == "abort":
        return "stop"
    return reason


_PARAMS = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
           "frequency_penalty", "repetition_penalty", "logprobs", "n", "seed", "stop")


def _param_of(message: str) -> str | None:
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


def build_app(engine: AsyncEngine, config: ServerConfig | None = None) -> FastAPI:
    """The FastAPI app; its lifespan starts the engine thread and drains it on shutdown."""
    config = config or ServerConfig()
    server = OpenAIServer(engine, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        engine.start()
        yield
        # uvicorn has already waited for in-flight HTTP requests (graceful shutdown); drain what
        # remains in the engine, then stop its thread.
        await asyncio.to_thread(engine.shutdown, config.drain_timeout)

    app = FastAPI(title="tokenfab", version="0.1.0", lifespan=lifespan)
    app.state.server = server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        server.metrics.error(exc.status)
        return error_response(exc.status, exc.message, exc.param, exc.code, exc.type)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        server.metrics.error(400)
        message, param, code = _validation_message(exc)
        return error_response(400, message, param, code)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        server.metrics.error(exc.status_code)
        message = str(exc.detail) if exc.detail else "error"
        if exc.status_code == 404:
            message = f"Unknown route {request.method} {request.url.path}"
        return error_response(exc.status_code, message, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        server.metrics.error(500)
        return error_response(500, f"internal server error: {type(exc).__name__}")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await server.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await server.chat_completions(body, request)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return server.models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        if model_id != server.model_name:
            raise APIError(404, f"The model '{model_id}' does not exist", param="model",
                           code="model_not_found")
        return ModelCard(id=server.model_name, created=server._created,
                         max_model_len=server.max_model_len).model_dump()

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return error_response(503, f"engine is not running: {engine.error!r}")
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        return await server.tokenize_endpoint(body)

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        return await server.detokenize_endpoint(body)

    if config.api_key:
        app.add_middleware(_AuthMiddleware, api_key=config.api_key, on_reject=server.metrics.error)
    return app
