"""`shaping.py`: each endpoint's request -> engine inputs in one pass, on the fake engine (no model, no HTTP)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.server.fake_engine import ByteTokenizer, FakeEngine
from tokenfab.engine.core.async_engine import AsyncEngine
from tokenfab.server.chat_tools import ChoiceShaper
from tokenfab.server.errors import APIError
from tokenfab.server.protocol import ChatCompletionRequest, CompletionRequest
from tokenfab.server.responses_protocol import ResponsesRequest
from tokenfab.server.serving import OpenAIServer, ServerConfig
from tokenfab.server.shaping import shape_chat, shape_completion, shape_responses

ASK = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}


def _shape(fn: Any, body: Any, *args: Any) -> Any:
    server = OpenAIServer(AsyncEngine(FakeEngine()), ServerConfig())
    try:
        return asyncio.run(fn(server, body, *args))
    finally:
        server.close()


def test_completion_prompts_echo_and_logprobs() -> None:
    body = CompletionRequest.model_validate({"prompt": [[98, 99], [100]], "echo": True, "logprobs": 2,
                                             "cache_salt": "s"})
    shaped = _shape(shape_completion, body)
    assert shaped.prompts == [[98, 99], [100]]
    assert shaped.prompt_texts == ["ab", "c"]  # token ids decoded for echo
    assert shaped.params.max_tokens == 16  # OpenAI's default for completions
    assert shaped.params.logprobs == 2 and shaped.params.prompt_logprobs == 2  # echo scores the prompt
    assert shaped.cache_salt == "s" and shaped.new_shaper is None


def test_chat_renders_the_template_once_and_shapes_tool_calls() -> None:
    body = ChatCompletionRequest.model_validate({"messages": ASK, "tools": [TOOL], "logprobs": True,
                                                 "top_logprobs": 3, "max_tokens": 5})
    shaped = _shape(shape_chat, body)
    assert shaped.prompts == [ByteTokenizer().encode("<user>hi\n<assistant>")]
    assert shaped.params.logprobs == 3 and shaped.params.max_tokens == 5
    shaper = shaped.shaper()
    assert isinstance(shaper, ChoiceShaper) and shaper.plan.mode == "auto"
    assert shaped.shaper() is not shaper  # one per choice
    message, reason = shaper.final('<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>', "stop")
    assert reason == "tool_calls" and message["tool_calls"][0]["function"]["name"] == "add"


def test_chat_checks_come_before_anything_is_rendered() -> None:
    body = ChatCompletionRequest.model_validate({"messages": ASK, "tool_choice": "required"})
    with pytest.raises(APIError) as e:
        _shape(shape_chat, body)
    assert e.value.param == "tool_choice"


def test_responses_conversation_and_field_names() -> None:
    body = ResponsesRequest.model_validate({"input": "hi", "instructions": "be brief", "max_output_tokens": 4})
    shaped = _shape(shape_responses, body, [])
    assert shaped.prompts == [ByteTokenizer().encode("<system>be brief\n<user>hi\n<assistant>")]
    assert shaped.messages == [{"role": "user", "content": "hi"}]  # stored without the instructions
    assert shaped.params.max_tokens == 4 and shaped.params.logprobs is None
    too_long = ResponsesRequest.model_validate({"input": "hi", "max_output_tokens": 10_000})
    with pytest.raises(APIError) as e:
        _shape(shape_responses, too_long, [])
    assert e.value.param == "max_output_tokens" and "max_tokens" not in e.value.message
