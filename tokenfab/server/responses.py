"""Pydantic models of what the server answers: they make the OpenAPI document true (every status a
route can return, with its body schema). The endpoints build plain dicts for speed; the tests
validate real responses against these models (and schemathesis against the OpenAPI document)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tokenfab"
    max_model_len: int | None = None
    root: str | None = None  # a LoRA adapter's path (vLLM's field)
    parent: str | None = None  # a LoRA adapter's base model


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PromptTokensDetails(BaseModel):
    cached_tokens: int


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class PromptLogprob(BaseModel):
    """vLLM's ``prompt_logprobs`` entry for one candidate token (keyed by its id as a string)."""

    logprob: float
    rank: int
    decoded_token: str


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatLogprob] | None = None


class ResponseFunctionCall(BaseModel):
    name: str
    arguments: str


class ResponseToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: ResponseFunctionCall


class ChatResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ResponseToolCall] | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


class HealthResponse(BaseModel):
    status: Literal["ok"] = "ok"


_ERROR_DESCRIPTIONS = {
    400: "Invalid request (OpenAI error body; `param` names the field)",
    401: "Missing or wrong API key",
    404: "Unknown route or model",
    413: "Request body larger than --max-request-bytes",
    429: "Too many requests waiting (--max-waiting)",
    500: "The request failed inside the engine (this request only)",
    503: "The engine is dead or shutting down",
}


def error_responses(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` entries of a route for these error statuses, all with the error body."""
    return {s: {"model": ErrorResponse, "description": _ERROR_DESCRIPTIONS[s]} for s in statuses}


def sse_or_json(model: type[BaseModel], what: str) -> dict[int | str, dict[str, Any]]:
    """A 200 that is ``model`` as JSON, or (``stream: true``) server-sent events of chunks."""
    return {200: {"model": model, "description": f"{what} (JSON), or with stream=true a text/event-stream of "
                  "`data: {chunk}` lines ending with `data: [DONE]`",
                  "content": {"text/event-stream": {"schema": _SSE_EVENT}}}}


# OpenAPI 3.1: the schema of a text/event-stream describes one event
_SSE_EVENT = {"type": "object", "required": ["data"],
              "properties": {"data": {"type": "string", "description": "a JSON chunk, an error body, or [DONE]"},
                             "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}
