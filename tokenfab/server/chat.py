"""/v1/chat/completions: the request shaped once (`shaping.shape_chat`), then the JSON response or the SSE stream."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenfab.engine.core.async_engine import RequestStream, StreamChunk
from tokenfab.server.logprobs import chat_logprobs, prompt_logprobs_json
from tokenfab.server.protocol import ChatCompletionRequest, random_id
from tokenfab.server.router_fields import without_reasoning
from tokenfab.server.serving import OpenAIServer
from tokenfab.server.shaping import Shaper, shape_chat
from tokenfab.server.streaming import (
    EngineStreamingResponse,
    collect,
    finish,
    generated_tokens,
    sse,
    sse_body,
    usage,
)


async def create_chat_completion(server: OpenAIServer, body: ChatCompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    shaped = await shape_chat(server, body)
    request_id = random_id("chatcmpl")
    stream = await server.submit(shaped.prompts, shaped.params, shaped.priority, arrival, request_id,
                                 shaped.cache_salt)
    created = int(time.time())
    num_prompt, k = len(shaped.prompts[0]), shaped.params.logprobs
    if body.stream:
        shapers = [shaped.shaper() for _ in range(stream.num_choices)]
        gen = sse_body(_chat_stream(server, body, stream, request_id, created, num_prompt, k, shapers),
                       stream, request, request_id)
        return EngineStreamingResponse(gen, stream)
    finals = await collect(stream, request)
    choices = []
    completion_tokens = 0
    prompt_lps = None
    for index in range(stream.num_choices):
        chunks = finals[index]
        last = chunks[-1]
        completion_tokens += len(last.token_ids or [])
        if prompt_lps is None:
            prompt_lps = next((c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None), None)
        logprobs = None
        if k is not None:
            gen_ids, lps = generated_tokens(chunks)
            logprobs = {"content": chat_logprobs(server.tokenizer, gen_ids, lps, k)}
        message, reason = shaped.shaper().final_chunk(last, finish(last.finish_reason))
        if not body.include_reasoning:
            message = without_reasoning(message)
        choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason,
                        "stop_reason": last.stop_reason})
    response = {
        "id": request_id, "object": "chat.completion", "created": created, "model": body.model or server.model_name,
        "choices": choices, "usage": usage(num_prompt, completion_tokens, finals),
        "system_fingerprint": None,
    }
    if body.prompt_logprobs is not None:
        response["prompt_logprobs"] = prompt_logprobs_json(prompt_lps)
    kv = finals[0][-1].kv_transfer_params if finals.get(0) else None
    if kv is not None:  # prefill/decode disaggregation: for the consumer (vLLM's field)
        response["kv_transfer_params"] = kv
    return JSONResponse(response)


async def _chat_stream(server: OpenAIServer, body: ChatCompletionRequest, stream: RequestStream,
                       request_id: str, created: int, num_prompt: int, k: int | None,
                       shapers: list[Shaper]) -> AsyncIterator[str]:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    continuous = include_usage and bool(body.stream_options and body.stream_options.continuous_usage_stats)
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created,
            "model": body.model or server.model_name}
    completion_tokens = 0
    generated = [0] * stream.num_choices
    finals: dict[int, list[StreamChunk]] = {}
    sent_prompt_logprobs = False

    def payload(choice: dict[str, Any]) -> str:
        p = dict(base)
        p["choices"] = [choice]
        if include_usage:  # vLLM's continuous_usage_stats: the choice's running usage in every chunk
            p["usage"] = usage(num_prompt, generated[choice["index"]]) if continuous else None
        return sse(p)

    for i in range(stream.num_choices):
        yield payload({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                       "finish_reason": None})
    async for chunk in stream:
        completion_tokens += len(chunk.delta_token_ids)
        generated[chunk.index] += len(chunk.delta_token_ids)
        logprobs = None
        if k is not None and chunk.delta_token_ids:
            logprobs = {"content": chat_logprobs(server.tokenizer, chunk.delta_token_ids,
                                                 chunk.delta_logprobs or [], k)}
        if chunk.finished:
            finals[chunk.index] = [chunk]
        if body.prompt_logprobs is not None and chunk.prompt_logprobs is not None and not sent_prompt_logprobs:
            sent_prompt_logprobs = True  # once, at the top level (vLLM's place for it)
            p = dict(base)
            p["choices"] = []
            p["prompt_logprobs"] = prompt_logprobs_json(chunk.prompt_logprobs)
            yield sse(p)
        if not (chunk.delta_text or chunk.delta_token_ids or chunk.finished or logprobs):
            continue
        shaper = shapers[chunk.index]
        deltas = shaper.feed_chunk(chunk)
        reason = finish(chunk.finish_reason)
        if chunk.finished:
            tail, reason = shaper.finish(reason)
            deltas += tail
        if not body.include_reasoning:  # reasoning-only deltas vanish
            deltas = [d for d in map(without_reasoning, deltas) if d]
        if not deltas and (logprobs or chunk.finished):
            deltas = [{}]
        for i, delta in enumerate(deltas):  # logprobs and the finish ride on the last delta of the chunk
            last = i == len(deltas) - 1
            yield payload({"index": chunk.index, "delta": delta, "logprobs": logprobs if last else None,
                           "finish_reason": reason if last else None,
                           "stop_reason": chunk.stop_reason if last else None})
    if include_usage:
        p = dict(base)
        p["choices"] = []
        p["usage"] = usage(num_prompt, completion_tokens, finals)
        yield sse(p)
