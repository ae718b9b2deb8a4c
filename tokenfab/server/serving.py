"""``OpenAIServer``: the state the endpoints share (engine, tokenizer, metrics) and the checks and
conversions every endpoint needs (model name, lengths, sampling parameters, submission)."""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any

from tokenfab.engine.async_engine import AsyncEngine, EngineDeadError, QueueFullError, RequestStream
from tokenfab.engine.sampling_params import SamplingParams
from tokenfab.server.chat import render_chat
from tokenfab.server.errors import APIError, param_of
from tokenfab.server.metrics import ServerMetrics
from tokenfab.server.protocol import DetokenizeRequest, ModelCard, ModelList, TokenizeRequest

logger = logging.getLogger("tokenfab.server")


@dataclass
class ServerConfig:
    api_key: str | None = None
    max_waiting: int | None = None
    drain_timeout: float = 30.0


class OpenAIServer:
    def __init__(self, engine: AsyncEngine, config: ServerConfig | None = None) -> None:
        self.engine = engine
        self.config = config or ServerConfig()
        if self.config.max_waiting is not None:
            engine.max_waiting = self.config.max_waiting
        self.tokenizer = engine.tokenizer
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = int(getattr(engine.engine, "vocab_size", 0) or 0)
        self.metrics = ServerMetrics(self.model_name, stats=engine.stats, waiting=engine.num_waiting)
        engine.on_first_token = self.metrics.on_first_token
        engine.on_finished = self.metrics.on_finished
        self._structured: Any = None
        self._structured_lock = asyncio.Lock()
        self.created = int(time.time())

    # ---- validation and request building ----
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(400, f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

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
                vocab = self.vocab_size or None
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
            raise APIError(400, str(e), param=param_of(str(e))) from e

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
            raise APIError(400, str(e), param=param_of(str(e))) from e
        except EngineDeadError as e:
            raise APIError(503, str(e), code="service_unavailable") from e
        except asyncio.CancelledError:
            stream.abort()
            raise
        return stream

    # ---- tokenizer endpoints ----
    async def tokenize_endpoint(self, body: TokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        if body.messages is not None:
            text = render_chat(self.tokenizer, body.messages, body.add_generation_prompt)
            ids = self.tokenize(text, add_special_tokens=False)
        elif body.prompt is not None:
            ids = self.tokenize(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise APIError(400, "either 'prompt' or 'messages' is required", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    async def detokenize_endpoint(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        vocab = self.vocab_size or len(self.tokenizer)
        if any(t < 0 or t >= vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": self.tokenizer.decode(body.tokens)}

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=self.created, max_model_len=self.max_model_len)

    def models(self) -> dict[str, Any]:
        return ModelList(data=[self.model_card()]).model_dump()
