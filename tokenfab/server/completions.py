"""/v1/completions: prompts (text or token ids), the JSON response and the SSE stream."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenfab.engine.async_engine import RequestStream, StreamChunk
from tokenfab.server.errors import APIError, error_body
from tokenfab.server.logprobs import completion_logprobs
from tokenfab.server.protocol import CompletionRequest, random_id
from tokenfab.server.streaming import ClientGone, EngineStreamingResponse, collect, finish, sse, usage, watch

if TYPE_CHECKING:
    from tokenfab.server.serving import OpenAIServer

logger = logging.getLogger("tokenfab.server")


async def create_completion(server: OpenAIServer, body: CompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    server.check_model(body.model)
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
    vocab = server.vocab_size
    for p in raw_prompts:
        if isinstance(p, str):
            prompt_ids.append(server.tokenize(p))
            prompt_texts.append(p)
        else:
            ids = [int(t) for t in p]
            if vocab and any(t < 0 or t >= vocab for t in ids):
                raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
            prompt_ids.append(ids)
            prompt_texts.append(server.tokenizer.decode(ids) if body.echo else "")
    explicit = body.max_tokens is not None
    max_tokens_list = [server.check_length(len(ids), body.max_tokens if explicit else 16, explicit, "prompt")
                       for ids in prompt_ids]
    max_tokens = min((m for m in max_tokens_list if m is not None), default=None)
    constraint = await server.build_constraint(body.response_format)
    params = server.sampling_params(body, max_tokens, body.logprobs, constraint)
    request_id = random_id("cmpl")
    stream = await server.submit(prompt_ids, params, body.priority, arrival, request_id)
    created = int(time.time())
    if body.stream:
        gen = _completion_stream(server, body, request, stream, request_id, created, prompt_ids, prompt_texts)
        return EngineStreamingResponse(gen, stream)
    finals = await collect(stream, request)
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
            logprobs = completion_logprobs(server.tokenizer, gen_ids, lps, body.logprobs,
                                           prompt_ids[p_idx] if body.echo else None,
                                           len(prompt_texts[p_idx]) if body.echo else 0)
        if body.echo:
            text = prompt_texts[p_idx] + text
        choices.append({"index": index, "text": text, "logprobs": logprobs,
                        "finish_reason": finish(last.finish_reason), "stop_reason": last.stop_reason})
    prompt_tokens = sum(len(ids) for ids in prompt_ids)
    return JSONResponse({
        "id": request_id, "object": "text_completion", "created": created, "model": server.model_name,
        "choices": choices, "usage": usage(prompt_tokens, completion_tokens, finals),
        "system_fingerprint": None,
    })


async def _completion_stream(server: OpenAIServer, body: CompletionRequest, request: Request,
                             stream: RequestStream, request_id: str, created: int, prompt_ids: list[list[int]],
                             prompt_texts: list[str]) -> AsyncIterator[str]:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    offsets = [0] * stream.num_choices
    started = [False] * stream.num_choices
    completion_tokens = 0
    finals: dict[int, list[StreamChunk]] = {}
    base = {"id": request_id, "object": "text_completion", "created": created, "model": server.model_name}
    watcher = watch(stream, request)
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
                logprobs = completion_logprobs(
                    server.tokenizer, chunk.delta_token_ids, chunk.delta_logprobs or [], body.logprobs, echo,
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
                                   "finish_reason": finish(chunk.finish_reason),
                                   "stop_reason": chunk.stop_reason}]
            if include_usage:
                payload["usage"] = None
            yield sse(payload)
        if include_usage:
            prompt_tokens = sum(len(ids) for ids in prompt_ids)
            payload = dict(base)
            payload["choices"] = []
            payload["usage"] = usage(prompt_tokens, completion_tokens, finals)
            yield sse(payload)
    except ClientGone:
        return
    except Exception as e:  # engine failure mid-stream: report it in-band
        logger.exception("stream %s failed", request_id)
        yield sse(error_body(500, f"generation failed: {e}"))
    finally:
        watcher.cancel()
        stream.abort()
    yield sse("[DONE]")
