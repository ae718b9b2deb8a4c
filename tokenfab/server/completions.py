"""/v1/completions: the prompts (text or token ids) shaped once (`shaping.shape_completion`), then the JSON
response or the SSE stream."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenfab.engine.core.async_engine import RequestStream, StreamChunk
from tokenfab.server.logprobs import completion_logprobs, prompt_logprobs_json
from tokenfab.server.protocol import CompletionRequest, random_id
from tokenfab.server.serving import OpenAIServer
from tokenfab.server.shaping import shape_completion
from tokenfab.server.streaming import (
    EngineStreamingResponse,
    collect,
    finish,
    generated_tokens,
    sse,
    sse_body,
    usage,
)


async def create_completion(server: OpenAIServer, body: CompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    shaped = await shape_completion(server, body)
    prompt_ids, prompt_texts = shaped.prompts, shaped.prompt_texts
    request_id = random_id("cmpl")
    stream = await server.submit(prompt_ids, shaped.params, shaped.priority, arrival, request_id, shaped.cache_salt)
    created = int(time.time())
    if body.stream:
        gen = sse_body(_completion_stream(server, body, stream, request_id, created, prompt_ids, prompt_texts),
                       stream, request, request_id)
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
        prompt_lps = next((c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None), None)
        logprobs = None
        if body.logprobs is not None:
            gen_ids, lps = generated_tokens(chunks)
            logprobs = completion_logprobs(server.tokenizer, gen_ids, lps, body.logprobs,
                                           prompt_ids[p_idx] if body.echo else None, prompt_lps,
                                           len(prompt_texts[p_idx]) if body.echo else 0)
        if body.echo:
            text = prompt_texts[p_idx] + text
        choice = {"index": index, "text": text, "logprobs": logprobs,
                  "finish_reason": finish(last.finish_reason), "stop_reason": last.stop_reason}
        if body.prompt_logprobs is not None:
            choice["prompt_logprobs"] = prompt_logprobs_json(prompt_lps)
        choices.append(choice)
    prompt_tokens = sum(len(ids) for ids in prompt_ids)
    response = {
        "id": request_id, "object": "text_completion", "created": created, "model": body.model or server.model_name,
        "choices": choices, "usage": usage(prompt_tokens, completion_tokens, finals),
        "system_fingerprint": None,
    }
    kv = finals[0][-1].kv_transfer_params if finals.get(0) else None
    if kv is not None:  # prefill/decode disaggregation: for the consumer (vLLM's field)
        response["kv_transfer_params"] = kv
    return JSONResponse(response)


async def _completion_stream(server: OpenAIServer, body: CompletionRequest, stream: RequestStream, request_id: str,
                             created: int, prompt_ids: list[list[int]], prompt_texts: list[str]) -> AsyncIterator[str]:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    continuous = include_usage and bool(body.stream_options and body.stream_options.continuous_usage_stats)
    generated = [0] * stream.num_choices
    offsets = [0] * stream.num_choices
    started = [False] * stream.num_choices
    completion_tokens = 0
    finals: dict[int, list[StreamChunk]] = {}
    base = {"id": request_id, "object": "text_completion", "created": created, "model": body.model or server.model_name}
    async for chunk in stream:
        i = chunk.index
        p_idx = chunk.prompt_index
        text = chunk.delta_text
        logprobs = None
        first = not started[i]
        started[i] = True
        if body.echo and first:
            text = prompt_texts[p_idx] + text
        if body.logprobs is not None and (chunk.delta_token_ids or (body.echo and first)):
            echo = prompt_ids[p_idx] if (body.echo and first) else None
            logprobs = completion_logprobs(
                server.tokenizer, chunk.delta_token_ids, chunk.delta_logprobs or [], body.logprobs, echo,
                chunk.prompt_logprobs, offsets[i] or (len(prompt_texts[p_idx]) if body.echo else 0))
            if logprobs["text_offset"]:
                offsets[i] = logprobs["text_offset"][-1] + len(logprobs["tokens"][-1])
        completion_tokens += len(chunk.delta_token_ids)
        generated[i] += len(chunk.delta_token_ids)
        if chunk.finished:
            finals[i] = [chunk]
        send_plp = body.prompt_logprobs is not None and chunk.prompt_logprobs is not None
        if not (text or chunk.finished or logprobs or send_plp):
            continue
        choice = {"index": i, "text": text, "logprobs": logprobs, "finish_reason": finish(chunk.finish_reason),
                  "stop_reason": chunk.stop_reason}
        if send_plp:
            choice["prompt_logprobs"] = prompt_logprobs_json(chunk.prompt_logprobs)
        payload = dict(base)
        payload["choices"] = [choice]
        if include_usage:  # vLLM's continuous_usage_stats: the choice's running usage in every chunk
            payload["usage"] = usage(len(prompt_ids[p_idx]), generated[i]) if continuous else None
        yield sse(payload)
    if include_usage:
        prompt_tokens = sum(len(ids) for ids in prompt_ids)
        payload = dict(base)
        payload["choices"] = []
        payload["usage"] = usage(prompt_tokens, completion_tokens, finals)
        yield sse(payload)
