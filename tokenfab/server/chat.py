"""/v1/chat/completions: chat template rendering, the JSON response and the SSE stream."""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tokenfab.engine.core.async_engine import RequestStream, StreamChunk
from tokenfab.server.chat_harmony import (
    HarmonyShaper,
    harmony_prefill,
    harmony_stop_token_ids,
    render_harmony_prompt,
    uses_harmony,
)
from tokenfab.server.chat_tools import (
    DEFAULT_TOOL_PARSER,
    ChoiceShaper,
    check_request,
    grammar_format,
    strict_tag_format,
    template_messages,
)
from tokenfab.server.errors import APIError
from tokenfab.server.logprobs import chat_logprobs, prompt_logprobs_json
from tokenfab.server.protocol import ChatCompletionRequest, ChatMessage, random_id
from tokenfab.server.reasoning import get_reasoning_parser, reasoning_parser_for_model
from tokenfab.server.streaming import (
    ClientGone,
    EngineStreamingResponse,
    collect,
    finish,
    sse,
    stream_error,
    usage,
    watch,
)
from tokenfab.server.tools import tool_parser_for_model

if TYPE_CHECKING:
    from tokenfab.server.serving import OpenAIServer

logger = logging.getLogger("tokenfab.server")


def render_chat(tokenizer: Any, messages: list[ChatMessage], add_generation_prompt: bool = True,
                continue_final_message: bool = False, kwargs: dict[str, Any] | None = None,
                chat_template: str | None = None) -> str:
    """The prompt text of ``messages`` under the model's chat template (or ``chat_template``, which
    the caller has checked is trusted). Runs in the server's tokenizer pool, off the event loop.

    Tool-call arguments go to the template as dicts (Hugging Face's convention); a template that fails on
    them (one that concatenates them as a string, as DeepSeek-V3's and V3.1's do) is tried again with the
    arguments as the JSON text the client sent."""
    if continue_final_message:
        add_generation_prompt = False
    extra = dict(kwargs or {})
    if chat_template is not None:
        extra["chat_template"] = chat_template
    has_calls = any(m.tool_calls for m in messages)
    error: Exception | None = None
    for as_text in (False, True) if has_calls else (False,):
        try:
            return tokenizer.apply_chat_template(
                template_messages(messages, arguments_as_text=as_text), tokenize=False,
                add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message, **extra,
            )
        except Exception as e:  # jinja errors: role order, bad kwargs
            error = error or e
    raise APIError(400, f"could not apply the chat template: {error}", param="messages") from error


@functools.lru_cache(maxsize=8)
def _model_config(path: str) -> dict[str, Any]:
    try:
        with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError):
        return {}
    return cfg if isinstance(cfg, dict) else {}


def parser_names(server: OpenAIServer) -> tuple[str | None, str | None]:
    """(tool parser, reasoning parser) for this server: ``--tool-call-parser``/``--reasoning-parser`` when set
    (``ServerConfig.tool_call_parser``/``reasoning_parser``), else by the model's type."""
    cfg = getattr(getattr(server.engine, "engine", None), "config", None)
    if cfg is None:  # the engine runs in its own process: read the model folder's config.json
        cfg = _model_config(str(getattr(server.tokenizer, "name_or_path", "") or ""))
    get = cfg.get if isinstance(cfg, dict) else (lambda key, default=None: getattr(cfg, key, default))
    model_type, archs = get("model_type"), get("architectures")
    template = getattr(server.tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else ""
    # a template without a tool format (the bundled SmolLM2): Hermes, the most common trained-in format
    by_model = tool_parser_for_model(model_type, archs, template) if "tool" in template else None
    tool = getattr(server.config, "tool_call_parser", None) or by_model or DEFAULT_TOOL_PARSER
    reasoning = getattr(server.config, "reasoning_parser", None) or reasoning_parser_for_model(model_type, archs)
    return tool, reasoning


async def create_chat_completion(server: OpenAIServer, body: ChatCompletionRequest, request: Request) -> Response:
    arrival = time.monotonic()
    server.check_model(body.model)
    if body.chat_template is not None and not server.config.trust_request_chat_template:
        raise APIError(400, "chat_template from the request is refused: this server uses the model's own "
                       "template (start it with --trust-request-chat-template to allow one)", param="chat_template")
    server.check_priority(body.priority)
    if body.top_logprobs is not None and not body.logprobs and body.top_logprobs > 0:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    plan = check_request(body)
    template_kwargs = body.chat_template_kwargs.model_dump(exclude_none=True) if body.chat_template_kwargs else None
    if body.reasoning_effort is not None:  # the top-level field wins over chat_template_kwargs (vLLM's rule)
        template_kwargs = {**(template_kwargs or {}), "reasoning_effort": body.reasoning_effort}
    tool_parser, reasoning_name = parser_names(server)
    harmony = uses_harmony(tool_parser, reasoning_name, body)
    if harmony:  # GPT-OSS: openai-harmony renders token ids (reasoning_effort in its system message)
        text = None
        ids = await server.offload(render_harmony_prompt, body, plan, param="messages")
    else:
        kwargs = dict(template_kwargs or {})
        if plan.tools and plan.mode != "none":
            kwargs["tools"] = plan.tools
        text = await server.render_chat(body.messages, body.add_generation_prompt, body.continue_final_message,
                                        kwargs or None, body.chat_template)
        ids = await server.tokenize(text, add_special_tokens=False, param="messages")
    explicit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    max_tokens = server.check_length(len(ids), explicit, explicit is not None, "messages")
    k = (body.top_logprobs or 0) if body.logprobs else None
    tool_format = grammar_format(plan)
    text_output = body.response_format is None or body.response_format.type == "text"
    if tool_format is not None and not text_output:
        raise APIError(400, f"tool_choice {plan.mode} is enforced by a grammar and cannot be combined with "
                       "response_format", param="response_format")
    constraint = await server.build_constraint(tool_format or body.response_format)
    tag = strict_tag_format(plan, tool_parser) if tool_format is None and text_output and not harmony else None
    if tag is not None:  # strict tools in auto mode (chat_tools): best effort, the schema check stays either way
        try:
            constraint = await server.build_constraint(tag)
        except APIError as e:
            logger.warning("strict tools not enforced by grammar for this request: %s", e.message)
    reasoning = (get_reasoning_parser(reasoning_name, chat_template_kwargs=template_kwargs, prompt=text)
                 if reasoning_name and not harmony else None)
    params = server.sampling_params(body, max_tokens, k, constraint, body.prompt_logprobs)
    if harmony:  # <|return|> ends an answer, <|call|> a tool call
        params.stop_token_ids = sorted({*params.stop_token_ids, *harmony_stop_token_ids()})

    def shaper() -> ChoiceShaper | HarmonyShaper:
        if harmony and not plan.constrained:
            return HarmonyShaper(plan, harmony_prefill(body, plan))
        return ChoiceShaper(plan, None if harmony else tool_parser, reasoning)

    server.check_request([ids], params, "messages")
    request_id = random_id("chatcmpl")
    stream = await server.submit([ids], params, body.priority, arrival, request_id, body.cache_salt)
    created = int(time.time())
    if body.stream:
        shapers = [shaper() for _ in range(stream.num_choices)]
        gen = _chat_stream(server, body, request, stream, request_id, created, len(ids), k, shapers)
        return EngineStreamingResponse(gen, stream)
    finals = await collect(stream, request)
    choices = []
    completion_tokens = 0
    prompt_lps = None
    for index in range(stream.num_choices):
        chunks = finals[index]
        last = chunks[-1]
        token_ids = last.token_ids or []
        completion_tokens += len(token_ids)
        if prompt_lps is None:
            prompt_lps = next((c.prompt_logprobs for c in chunks if c.prompt_logprobs is not None), None)
        logprobs = None
        if k is not None:
            lps = [lp for c in chunks for lp in (c.delta_logprobs or [])]
            gen_ids = [t for c in chunks for t in c.delta_token_ids]
            logprobs = {"content": chat_logprobs(server.tokenizer, gen_ids, lps, k)}
        s = shaper()
        if isinstance(s, HarmonyShaper):
            message, reason = s.final_ids(token_ids, finish(last.finish_reason))
        else:
            message, reason = s.final(last.text or "", finish(last.finish_reason))
        choices.append({"index": index, "message": message, "logprobs": logprobs, "finish_reason": reason,
                        "stop_reason": last.stop_reason})
    response = {
        "id": request_id, "object": "chat.completion", "created": created, "model": server.model_name,
        "choices": choices, "usage": usage(len(ids), completion_tokens, finals),
        "system_fingerprint": None,
    }
    if body.prompt_logprobs is not None:
        response["prompt_logprobs"] = prompt_logprobs_json(prompt_lps)
    return JSONResponse(response)


async def _chat_stream(server: OpenAIServer, body: ChatCompletionRequest, request: Request, stream: RequestStream,
                       request_id: str, created: int, num_prompt: int, k: int | None,
                       shapers: list[ChoiceShaper | HarmonyShaper]) -> AsyncIterator[str]:
    include_usage = bool(body.stream_options and body.stream_options.include_usage)
    continuous = include_usage and bool(body.stream_options and body.stream_options.continuous_usage_stats)
    base = {"id": request_id, "object": "chat.completion.chunk", "created": created,
            "model": server.model_name}
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

    watcher = watch(stream, request)
    try:
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
    except ClientGone:
        return
    except Exception as e:  # engine failure mid-stream: report it in-band, to this client only
        yield sse(stream_error(e, request_id))
    finally:
        watcher.cancel()
        stream.abort()
    yield sse("[DONE]")
