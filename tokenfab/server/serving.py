"""``OpenAIServer``: the state the endpoints share (engine, tokenizer, metrics) and the checks and
conversions every endpoint needs (model name, lengths, sampling parameters, submission).

Everything a request can get wrong is found here, before anything is queued: the engine's own
``check_request`` (vocabulary, lengths, every sampling bound) runs on each prompt first, so a bad
request is a 400 and the engine never sees it. Tokenization and chat templating run in a
one-thread pool, off the event loop (a megabyte prompt must not stall every other client's stream).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from tokenfab.engine.core.async_engine import AsyncEngine, RequestStream
from tokenfab.engine.requests.errors import EngineDeadError, QueueFullError
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.server.chat_template import render_chat
from tokenfab.server.errors import APIError, param_of
from tokenfab.server.limits import DEFAULT_MAX_REQUEST_BYTES
from tokenfab.server.lora_registry import REQUEST_LORA, LoRARegistry, parse_lora_module
from tokenfab.server.metrics import ServerMetrics
from tokenfab.server.protocol import DetokenizeRequest, TokenizeRequest
from tokenfab.server.responses import ModelCard, ModelList

logger = logging.getLogger("tokenfab.server")
T = TypeVar("T")


@dataclass
class ServerConfig:
    api_key: str | None = None
    max_waiting: int | None = None
    drain_timeout: float = 30.0
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_prompts_per_request: int = 256
    trust_request_chat_template: bool = False
    tool_call_parser: str | None = None  # None: by model type (model_parsers.parser_names)
    reasoning_parser: str | None = None
    responses_store_size: int = 1024  # /v1/responses kept for previous_response_id (responses_store.py)
    responses_ttl: float = 3600.0
    # multi-LoRA (lora_registry.py): --enable-lora, --lora-modules, --max-lora-rank, --max-loras
    enable_lora: bool = False
    lora_modules: list | None = None
    max_lora_rank: int | None = None
    max_loras: int = 1  # --max-loras: adapters one engine step holds (reported by vllm:lora_requests_info)
    load_report: str = "vllm-router"  # the shape of GET /get_load (fleet_routes.py): vllm-router or sglang-router


class OpenAIServer:
    def __init__(self, engine: AsyncEngine, config: ServerConfig | None = None) -> None:
        self.engine = engine
        self.config = config or ServerConfig()
        if self.config.max_waiting is not None:
            engine.max_waiting = self.config.max_waiting
        # The server's own copy: the engine thread detokenizes with the engine's tokenizer while the
        # pool below tokenizes, and a fast tokenizer shared by two threads can fail with "Already
        # borrowed" (its Rust object takes a mutable borrow when its settings change).
        self.tokenizer = _own_copy(engine.tokenizer)
        self.model_name = engine.model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.vocab_size
        self.metrics = ServerMetrics(self.model_name, stats=engine.stats, waiting=engine.num_waiting)
        # the engine's metric hooks are this front end's while it is open; close() gives the previous
        # front end on the same engine (tests run several over one engine) its hooks back
        self._previous_hooks = (engine.on_first_token, engine.on_finished)
        engine.on_first_token = self.metrics.on_first_token
        engine.on_finished = self.metrics.on_finished
        self._structured: Any = None
        self._structured_lock = asyncio.Lock()
        # One worker: the event loop stays free, which is the point, and the copy is used by one thread.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenfab-tok")
        self.created = int(time.time())
        self.loras = LoRARegistry(self.config.enable_lora, self.model_name, self.config.max_lora_rank,
                                  engine.lora_targets)
        for spec in self.config.lora_modules or []:
            if not self.config.enable_lora:
                raise ValueError("--lora-modules needs --enable-lora")
            self.loras.add(*parse_lora_module(spec), stable_id=True)
        if self.config.enable_lora:
            self.metrics.register_lora(lambda: list(self.loras.adapters), self.config.max_loras)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.engine.on_first_token == self.metrics.on_first_token:
            self.engine.on_first_token, self.engine.on_finished = self._previous_hooks

    # ---- off the event loop ----
    async def offload(self, fn: Callable[..., T], *args: Any, param: str | None = None) -> T:
        """Run tokenizer work in the pool; a tokenizer that rejects the text is a 400 on ``param``."""
        try:
            return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)
        except APIError:
            raise
        except (TypeError, ValueError, UnicodeError) as e:
            raise APIError(400, f"{param or 'input'}: cannot tokenize this text: {e}", param=param) from e

    def _encode(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens))

    async def tokenize(self, prompt: str, add_special_tokens: bool = True, param: str = "prompt") -> list[int]:
        return await self.offload(self._encode, prompt, add_special_tokens, param=param)

    async def tokenize_all(self, prompts: list[str], param: str = "prompt") -> list[list[int]]:
        return await self.offload(lambda: [self._encode(p) for p in prompts], param=param)

    async def detokenize_all(self, prompts: list[list[int]]) -> list[str]:
        return await self.offload(lambda: [self.tokenizer.decode(p) for p in prompts], param="prompt")

    async def render_chat(self, messages: Any, add_generation_prompt: bool = True,
                          continue_final_message: bool = False, kwargs: dict[str, Any] | None = None,
                          chat_template: str | None = None) -> str:
        return await self.offload(render_chat, self.tokenizer, messages, add_generation_prompt,
                                  continue_final_message, kwargs, chat_template, param="messages")

    # ---- validation and request building ----
    def check_alive(self) -> None:
        if self.engine.is_dead:
            raise APIError(503, f"The engine is dead and cannot serve requests: {self.engine.error}",
                           code="engine_dead")

    def check_model(self, model: str | None) -> None:
        """The request's model: the base, or a LoRA adapter by name (kept for ``submit``)."""
        self.check_alive()
        REQUEST_LORA.set(None if model is None or model == self.model_name else self.loras.resolve(model))
        if model is not None and model != self.model_name and REQUEST_LORA.get() is None:
            raise APIError(400, f"The model '{model}' does not exist; this server serves '{self.model_name}'",
                           param="model", code="model_not_found")

    def check_priority(self, priority: int) -> None:
        if priority != 0 and self.engine.scheduling_policy != "priority":
            raise APIError(400, "priority is only honoured when the server runs with --scheduling-policy "
                           f"priority (this one: {self.engine.scheduling_policy}); send 0 or leave it out",
                           param="priority")

    def check_length(self, num_prompt: int, max_tokens: int | None, explicit: bool, param: str) -> int | None:
        if num_prompt == 0:
            raise APIError(400, "The prompt is empty", param=param)
        if max_tokens == 0:  # score the prompt only: it may fill the whole context
            if num_prompt > self.max_model_len:
                raise APIError(400, f"This model's maximum context length is {self.max_model_len} tokens, but "
                               f"the prompt has {num_prompt} tokens", param=param, code="context_length_exceeded")
            return 0
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
        from tokenfab.engine.runner.structured import StructuredOutputCompiler, StructuredOutputError

        if response_format.type == "json_schema" and (response_format.json_schema is None
                                                      or response_format.json_schema.json_schema is None):
            raise APIError(400, "response_format.json_schema.schema is required",
                           param="response_format.json_schema")
        async with self._structured_lock:
            if self._structured is None:
                try:
                    self._structured = await asyncio.to_thread(StructuredOutputCompiler, self.tokenizer,
                                                               self.vocab_size)
                except Exception as e:
                    logger.exception("cannot set up structured output")
                    raise APIError(400, f"response_format is not available with this model's tokenizer: {e}",
                                   param="response_format") from e
        rf = response_format.model_dump(by_alias=True, exclude_none=True)
        try:
            constraint = await asyncio.to_thread(self._structured.from_response_format, rf)
        except StructuredOutputError as e:
            raise APIError(400, str(e), param="response_format") from e
        if constraint is not None:  # an engine-core process compiles the grammar again from this spec
            constraint.spec_json = json.dumps(rf)
        return constraint

    def sampling_params(self, body: Any, max_tokens: int | None, logprobs: int | None,
                        constraint: Any, prompt_logprobs: int | None = None) -> SamplingParams:
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
                prompt_logprobs=prompt_logprobs,
                logit_bias=body.logit_bias_ids(),
                skip_special_tokens=body.skip_special_tokens,
                include_stop_str_in_output=body.include_stop_str_in_output or body.no_stop_trim,
                speculative=body.speculative,
                constraint=constraint,
                kv_transfer_params=body.kv_transfer_params,
            )
        except ValueError as e:
            raise APIError(400, str(e), param=param_of(str(e))) from e

    def check_request(self, prompts: list[list[int]], params: SamplingParams, param: str) -> None:
        """The engine's own checks against the loaded model, before anything is queued."""
        for ids in prompts:
            try:
                self.engine.check_request(ids, params)
            except ValueError as e:
                raise APIError(400, str(e), param=param_of(str(e)) or param) from e

    async def submit(self, prompts: list[list[int]], params: SamplingParams, priority: int,
                     arrival: float, request_id: str, cache_salt: str | None = None) -> RequestStream:
        try:
            lora = REQUEST_LORA.get()  # set by check_model in this request's task
            stream = self.engine.add_requests(request_id, prompts, params, priority, arrival_time=arrival,
                                              cache_salt=cache_salt, **({"lora_request": lora} if lora else {}))
        except QueueFullError as e:
            raise APIError(429, str(e), code="rate_limit_exceeded", type="rate_limit_error") from e
        except EngineDeadError as e:
            raise APIError(503, str(e), code="service_unavailable") from e
        except ValueError as e:
            raise APIError(400, str(e), param=param_of(str(e))) from e
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
            text = await self.render_chat(body.messages, body.add_generation_prompt, body.continue_final_message)
            ids = await self.tokenize(text, add_special_tokens=False, param="messages")
        elif body.prompt is not None:
            ids = await self.tokenize(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            raise APIError(400, "either 'prompt' or 'messages' is required", param="prompt")
        return {"tokens": ids, "count": len(ids), "max_model_len": self.max_model_len}

    async def detokenize_endpoint(self, body: DetokenizeRequest) -> dict[str, Any]:
        self.check_model(body.model)
        vocab = self.vocab_size
        if any(t >= vocab for t in body.tokens):
            raise APIError(400, f"token ids must be in [0, {vocab})", param="tokens")
        return {"prompt": await self.offload(self.tokenizer.decode, body.tokens, param="tokens")}

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model_name, created=self.created, max_model_len=self.max_model_len)

    def models(self) -> dict[str, Any]:
        cards = [self.model_card()] + [ModelCard(**c, max_model_len=self.max_model_len) for c in self.loras.cards()]
        return ModelList(data=cards).model_dump()


def _own_copy(tokenizer: Any) -> Any:
    """A private deep copy of the engine's tokenizer (the same one when it cannot be copied)."""
    if tokenizer is None:
        return None
    try:
        return copy.deepcopy(tokenizer)
    except Exception:  # a tokenizer object that refuses to be copied: share it (and risk the race)
        return tokenizer
