"""One pass from an OpenAI request to what the engine call needs (`ShapedRequest`), one function per endpoint.

A handler calls its function once, then submits the result and streams or collects the output:

- `shape_completion` (/v1/completions): the prompts (text tokenized, token ids checked), their texts for echo,
  max_tokens, logprobs (echo scores the prompt too), the ``response_format`` grammar, sampling parameters.
- `shape_chat` (/v1/chat/completions): the request's own checks (model, trusted template, priority, logprobs),
  then the chat path below.
- `shape_responses` (/v1/responses): the input items become the chat request they amount to
  (``responses_input.py``), which takes the chat path below, its errors renamed to this API's fields.

The chat path, in order: tools and tool_choice (`tool_plan.plan_tools`), the parsers (`model_parsers`), the
prompt (GPT-OSS: token ids rendered by openai-harmony, ``chat_harmony.py``; else the chat template, then the
tokenizer), its length and max_tokens, the grammar (tool_choice required/named or ``response_format``; strict
tools in auto mode, chat only: ``chat_grammar.py``), the reasoning parser, the sampling parameters (Harmony's
stop tokens added), the engine's own check. Every 400 comes before anything is queued.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.server.chat_grammar import grammar_format, strict_tag_format
from tokenfab.server.chat_harmony import (
    HarmonyShaper,
    harmony_prefill,
    harmony_stop_token_ids,
    render_harmony_prompt,
    uses_harmony,
)
from tokenfab.server.chat_tools import ChoiceShaper
from tokenfab.server.errors import APIError
from tokenfab.server.model_parsers import parser_names
from tokenfab.server.protocol import ChatCompletionRequest, CompletionRequest, ResponseFormat
from tokenfab.server.reasoning import get_reasoning_parser
from tokenfab.server.responses_input import chat_request, conversation, responses_names, template_kwargs, text_format
from tokenfab.server.responses_protocol import ResponsesRequest
from tokenfab.server.serving import OpenAIServer
from tokenfab.server.tool_plan import ToolPlan, plan_tools

logger = logging.getLogger("tokenfab.server")

Shaper = ChoiceShaper | HarmonyShaper


@dataclass
class ShapedRequest:
    """What one engine call needs (``OpenAIServer.submit``), and what shapes its output."""

    prompts: list[list[int]]  # token ids, one list per prompt (chat and responses: one)
    params: SamplingParams  # grammar constraint, stop tokens and logprobs included
    priority: int = 0
    cache_salt: str | None = None
    prompt_texts: list[str] = field(default_factory=list)  # completions: each prompt's text (for echo)
    messages: list[dict[str, Any]] = field(default_factory=list)  # responses: the conversation, to store
    new_shaper: Callable[[], Shaper] | None = None  # chat and responses: the output shaper of one choice

    def shaper(self) -> Shaper:
        """A fresh output shaper for one choice (tool calls, reasoning; Harmony for GPT-OSS)."""
        assert self.new_shaper is not None, "only chat and responses requests shape their output"
        return self.new_shaper()


async def shape_completion(server: OpenAIServer, body: CompletionRequest) -> ShapedRequest:
    server.check_model(body.model)
    if body.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise APIError(400, "best_of is not supported (use n)", param="best_of")
    if body.max_tokens == 0 and not body.echo:
        raise APIError(400, "max_tokens 0 (score the prompt, generate nothing) needs echo: true",
                       param="max_tokens")
    server.check_priority(body.priority)
    raw = body.prompt
    if isinstance(raw, str):
        raw_prompts: list[Any] = [raw]
    elif raw and all(isinstance(x, int) for x in raw):
        raw_prompts = [raw]
    else:
        raw_prompts = list(raw)
    if not raw_prompts:
        raise APIError(400, "The prompt is empty", param="prompt")
    if len(raw_prompts) > server.config.max_prompts_per_request:
        raise APIError(400, f"{len(raw_prompts)} prompts in one request; this server takes at most "
                       f"{server.config.max_prompts_per_request} (--max-prompts-per-request)", param="prompt")
    texts = [p for p in raw_prompts if isinstance(p, str)]
    encoded = iter(await server.tokenize_all(texts) if texts else [])
    prompt_ids: list[list[int]] = [next(encoded) if isinstance(p, str) else list(p) for p in raw_prompts]
    vocab = server.vocab_size
    for ids in prompt_ids:
        if any(t >= vocab for t in ids):
            raise APIError(400, f"prompt token ids must be in [0, {vocab})", param="prompt")
    prompt_texts = [p if isinstance(p, str) else "" for p in raw_prompts]
    if body.echo and len(texts) < len(raw_prompts):
        decoded = iter(await server.detokenize_all([p for p in raw_prompts if not isinstance(p, str)]))
        prompt_texts = [p if isinstance(p, str) else next(decoded) for p in raw_prompts]
    explicit = body.max_tokens is not None
    max_tokens_list = [server.check_length(len(ids), body.max_tokens if explicit else 16, explicit, "prompt")
                       for ids in prompt_ids]
    max_tokens = min((m for m in max_tokens_list if m is not None), default=None)
    # echo + logprobs scores the prompt too (OpenAI's legacy use, lm-eval's loglikelihood)
    echo_k = body.logprobs if body.echo else None
    wanted = [k for k in (echo_k, body.prompt_logprobs) if k is not None]
    prompt_k = max(wanted) if wanted else None
    constraint = await server.build_constraint(body.response_format)
    params = server.sampling_params(body, max_tokens, body.logprobs, constraint, prompt_k)
    server.check_request(prompt_ids, params, "prompt")
    return ShapedRequest(prompt_ids, params, body.priority, body.cache_salt, prompt_texts=prompt_texts)


async def shape_chat(server: OpenAIServer, body: ChatCompletionRequest) -> ShapedRequest:
    server.check_model(body.model)
    if body.chat_template is not None and not server.config.trust_request_chat_template:
        raise APIError(400, "chat_template from the request is refused: this server uses the model's own "
                       "template (start it with --trust-request-chat-template to allow one)", param="chat_template")
    server.check_priority(body.priority)
    if body.top_logprobs is not None and not body.logprobs and body.top_logprobs > 0:
        raise APIError(400, "top_logprobs requires logprobs to be true", param="top_logprobs")
    plan = plan_tools(body)
    kwargs = body.chat_template_kwargs.model_dump(exclude_none=True) if body.chat_template_kwargs else None
    if body.reasoning_effort is not None:  # the top-level field wins over chat_template_kwargs (vLLM's rule)
        kwargs = {**(kwargs or {}), "reasoning_effort": body.reasoning_effort}
    prompt = await _chat_prompt(server, body, plan, kwargs, "messages")
    shaped = await _chat_engine_inputs(server, body, prompt, body.response_format, "messages", strict_tags=True)
    shaped.priority, shaped.cache_salt = body.priority, body.cache_salt
    return shaped


async def shape_responses(server: OpenAIServer, body: ResponsesRequest,
                          history: list[dict[str, Any]]) -> ShapedRequest:
    """``history``: the stored conversation of ``previous_response_id`` (the handler looks it up)."""
    conv = conversation(body, history)
    messages = ([{"role": "system", "content": body.instructions}] if body.instructions else []) + conv
    with responses_names():
        chat = chat_request(body, messages)
        plan = plan_tools(chat)
        prompt = await _chat_prompt(server, chat, plan, template_kwargs(body), "input")
        shaped = await _chat_engine_inputs(server, chat, prompt, text_format(body), "input", strict_tags=False)
    shaped.messages = conv  # stored without the instructions, as OpenAI does
    return shaped


@dataclass
class _ChatPrompt:
    ids: list[int]
    text: str | None  # the rendered template (None: Harmony token ids)
    plan: ToolPlan
    tool_parser: str | None
    reasoning_parser: str | None
    harmony: bool
    template_kwargs: dict[str, Any] | None
    max_tokens: int | None


async def _chat_prompt(server: OpenAIServer, chat: ChatCompletionRequest, plan: ToolPlan,
                       template_kwargs: dict[str, Any] | None, param: str) -> _ChatPrompt:
    """The prompt's token ids (Harmony or the chat template with ``tools``) and the max_tokens its length allows."""
    tool_parser, reasoning_name = parser_names(server)
    harmony = uses_harmony(tool_parser, reasoning_name, chat)
    text: str | None = None
    if harmony:  # GPT-OSS: openai-harmony renders token ids (reasoning_effort in its system message)
        ids = await server.offload(render_harmony_prompt, chat, plan, param=param)
    else:
        kwargs = dict(template_kwargs or {})
        if plan.tools and plan.mode != "none":
            kwargs["tools"] = plan.tools
        text = await server.render_chat(chat.messages, chat.add_generation_prompt, chat.continue_final_message,
                                        kwargs or None, chat.chat_template)
        ids = await server.tokenize(text, add_special_tokens=False, param=param)
    explicit = chat.max_completion_tokens if chat.max_completion_tokens is not None else chat.max_tokens
    max_tokens = server.check_length(len(ids), explicit, explicit is not None, param)
    return _ChatPrompt(ids, text, plan, tool_parser, reasoning_name, harmony, template_kwargs, max_tokens)


async def _chat_engine_inputs(server: OpenAIServer, chat: ChatCompletionRequest, prompt: _ChatPrompt,
                              response_format: ResponseFormat | None, param: str,
                              strict_tags: bool) -> ShapedRequest:
    """The grammar, reasoning parser and sampling parameters of a rendered chat prompt, checked by the engine."""
    plan, harmony = prompt.plan, prompt.harmony
    k = (chat.top_logprobs or 0) if chat.logprobs else None
    tool_format = grammar_format(plan)
    text_output = response_format is None or response_format.type == "text"
    if tool_format is not None and not text_output:
        raise APIError(400, f"tool_choice {plan.mode} is enforced by a grammar and cannot be combined with "
                       "response_format", param="response_format")
    constraint = await server.build_constraint(tool_format or response_format)
    tag = (strict_tag_format(plan, prompt.tool_parser)
           if strict_tags and tool_format is None and text_output and not harmony else None)
    if tag is not None:  # strict tools in auto mode: best effort, the schema check (call_ok) stays either way
        try:
            constraint = await server.build_constraint(tag)
        except APIError as e:
            logger.warning("strict tools not enforced by grammar for this request: %s", e.message)
    reasoning = (get_reasoning_parser(prompt.reasoning_parser, chat_template_kwargs=prompt.template_kwargs,
                                      prompt=prompt.text)
                 if prompt.reasoning_parser and not harmony and chat.separate_reasoning else None)
    params = server.sampling_params(chat, prompt.max_tokens, k, constraint, chat.prompt_logprobs)
    if harmony:  # <|return|> ends an answer, <|call|> a tool call
        params.stop_token_ids = sorted({*params.stop_token_ids, *harmony_stop_token_ids()})
    server.check_request([prompt.ids], params, param)

    def new_shaper() -> Shaper:
        if harmony and not plan.constrained:
            return HarmonyShaper(plan, harmony_prefill(chat, plan))
        return ChoiceShaper(plan, None if harmony else prompt.tool_parser, reasoning)

    return ShapedRequest([prompt.ids], params, new_shaper=new_shaper)
