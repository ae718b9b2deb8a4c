"""Reasoning end to end: a live server on the bundled model with ``--reasoning-parser deepseek_r1`` and
``--tool-call-parser glm45`` forced, called with the official openai client.

The bundled SmolLM2 never writes ``<think>``, so its output is made to be a known reasoning-and-tool-call text
by the grammar: ``response_format`` with a JSON schema whose only value is that text (the output is its JSON
string literal, quotes included). The request's chat template (the server trusts request templates here) ends
the generation prompt with ``<think>``, as DeepSeek-R1's does. The text carries a tool call inside the
reasoning (must stay reasoning) and one after ``</think>`` (must become a tool call); GLM-4.7's call format needs
no quotes, so the JSON literal leaves it intact. Streamed, the reasoning must come as several deltas.

The server is a second front end over the session's engine (conftest's ``served``: the model loads once), and the
four long generations are sent together, so they cost one generation's time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest

from tests.server.conftest import LiveServer, Served
from tokenfab.server.app import ServerConfig, build_app

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
IN_REASONING = "<tool_call>add<arg_key>a</arg_key><arg_value>9</arg_value></tool_call>"
CALL = ("<tool_call>add<arg_key>a</arg_key><arg_value>1</arg_value><arg_key>b</arg_key><arg_value>2</arg_value>"
        "</tool_call>")
OUTPUT = f"Maybe {IN_REASONING}, no.</think>Sure. {CALL}"
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
            "<|im_start|>assistant\n<think>\n")
ASK = [{"role": "user", "content": "Add 1 and 2."}]


@pytest.fixture(scope="module")
def reasoning_client(served: Served) -> Iterator[openai.OpenAI]:
    """A second front end with the parsers forced, over the session's engine (the bundled model, loaded once):
    its lifespan is off, so it neither starts nor stops that engine."""
    config = ServerConfig(drain_timeout=5, reasoning_parser="deepseek_r1", tool_call_parser="glm45",
                          trust_request_chat_template=True)
    app = build_app(served.engine, config)
    server = LiveServer(app, lifespan="off")
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    server.stop()
    app.state.server.close()


def _request(template: str = TEMPLATE, tools: list | None = TOOLS, **kw) -> dict:
    forced = {"type": "json_schema", "json_schema": {"name": "out", "schema": {"type": "string", "enum": [OUTPUT]}}}
    return dict(model=None, messages=ASK, temperature=0.0, max_tokens=400, response_format=forced,
                extra_body={"chat_template": template}, **({"tools": tools} if tools else {}), **kw)


@pytest.fixture(scope="module")
def answers(reasoning_client: openai.OpenAI) -> dict[str, Any]:
    """This file's four forced generations (~170 tokens each), sent at once: the engine steps them as one batch.
    no_tools: content untouched; with_tools: the calls parsed; streamed: the same request as with_tools, streamed
    (its chunks); closed: a template that closes the thinking block."""
    requests = {"no_tools": _request(tools=None), "with_tools": _request(), "streamed": _request(stream=True),
                "closed": _request(template=TEMPLATE + "</think>\n", tools=None)}

    def send(kw: dict) -> Any:
        out = reasoning_client.chat.completions.create(**kw)
        return list(out) if kw.get("stream") else out

    with ThreadPoolExecutor(len(requests)) as pool:
        return dict(zip(requests, pool.map(send, requests.values())))


def test_forced_output_is_the_known_text(answers):
    m = answers["no_tools"].choices[0].message  # no tools: content untouched
    assert m.model_extra["reasoning_content"] == json.dumps(OUTPUT).split("</think>")[0]  # '"Maybe <tool_call>...'
    assert m.content == json.dumps(OUTPUT).split("</think>")[1]


def test_reasoning_and_tool_calls_from_content_only(answers):
    choice = answers["with_tools"].choices[0]
    m = choice.message
    assert choice.finish_reason == "tool_calls"
    reasoning = m.model_extra["reasoning_content"]
    assert reasoning == m.model_extra["reasoning"] and IN_REASONING in reasoning  # left alone in reasoning
    assert [(c.function.name, json.loads(c.function.arguments)) for c in m.tool_calls] == [("add", {"a": 1, "b": 2})]
    assert m.content == 'Sure.\n"'  # the JSON literal's closing quote is content after the call


def test_reasoning_streams_as_deltas_and_matches(answers):
    full = answers["with_tools"].choices[0].message
    reasoning_deltas, content, calls, finish = [], "", {}, None
    for chunk in answers["streamed"]:
        for ch in chunk.choices:
            extra = ch.delta.model_extra or {}
            if extra.get("reasoning_content"):
                assert extra["reasoning"] == extra["reasoning_content"]
                reasoning_deltas.append(extra["reasoning_content"])
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or ():
                c = calls.setdefault(tc.index, {"name": tc.function.name, "arguments": ""})
                c["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    assert len(reasoning_deltas) > 5  # streamed as it was generated, not in one piece at the end
    assert "".join(reasoning_deltas) == full.model_extra["reasoning_content"]
    assert content == full.content and finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (c.function.name, c.function.arguments) for c in full.tool_calls]


def test_thinking_switched_off_by_the_template_is_all_content(answers):
    m = answers["closed"].choices[0].message  # the template closes the block (thinking off): the parser sees it
    assert m.model_extra.get("reasoning_content") is None and m.content == json.dumps(OUTPUT)


def test_second_turn_takes_the_assistant_message_back_as_returned(reasoning_client, answers):
    """The client sends the first answer back as it got it (reasoning_content, reasoning, tool_calls) with the
    tool's result: accepted, and the reasoning reaches the template (rendered here as [r:...])."""
    m = answers["with_tools"].choices[0].message
    messages = [*ASK, m.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": m.tool_calls[0].id, "content": "3"}]
    assert {"reasoning", "reasoning_content", "tool_calls"} <= set(messages[1])
    template = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.reasoning_content %}[r:"
                "{{ m.reasoning_content }}]{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}<|im_start|>assistant\n")
    r = reasoning_client.chat.completions.create(model=None, messages=messages, max_tokens=2, temperature=0.0,
                                                 extra_body={"chat_template": template, "prompt_logprobs": 0})
    prompt = "".join(next(iter(lp.values()))["decoded_token"] for lp in r.model_extra["prompt_logprobs"][1:])
    assert "[r:" + m.model_extra["reasoning_content"][:20] in prompt
