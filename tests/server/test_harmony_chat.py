"""GPT-OSS in /v1/chat/completions through Harmony (server/chat_harmony.py).

Fixed completions (token ids rendered by openai-harmony itself, the independent reference for the format) go
through the chat shaper streamed token by token and whole; then a live server on a tiny random-weight GPT-OSS
model (o200k Harmony vocabulary, tests/server/harmony_model.py) is called with the official openai client:
the prompt's token ids are Harmony's rendering with the request's reasoning_effort, a bad effort is a 400,
streamed equals non-streamed, a named tool's arguments validate against its schema, a tool turn goes back in.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tests.server.harmony_skip import skip_without_harmony_vocab

pytestmark = skip_without_harmony_vocab()

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Zürich"]}},
           "required": ["city"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                           "parameters": WEATHER}}]
ASK = [{"role": "user", "content": "Weather in Zürich?"}]


def _reply(*messages) -> list[int]:
    """Token ids of an assistant reply as the model writes it (after the prompt's ``<|start|>assistant``)."""
    from tokenfab.server.reasoning.harmony_vocab import harmony_encoding

    enc = harmony_encoding()
    head = enc.encode("<|start|>assistant", allowed_special="all")
    ids = [t for m in messages for t in enc.render(m)]
    assert ids[: len(head)] == head
    return ids[len(head):]


def _analysis(text: str):
    from openai_harmony import Message, Role

    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel("analysis")


def _say(text: str, channel: str = "final"):
    from openai_harmony import Message, Role

    return Message.from_role_and_content(Role.ASSISTANT, text).with_channel(channel)


def _call(name: str, args: str):
    from openai_harmony import Message, Role

    return (Message.from_role_and_content(Role.ASSISTANT, args).with_channel("commentary")
            .with_recipient(f"functions.{name}").with_content_type("<|constrain|>json"))


def _shape(ids: list[int], mode: str = "auto", finish: str = "stop"):
    """(final message, final finish_reason, the streamed deltas joined the way a client joins them)."""
    from tokenfab.server.chat_harmony import HarmonyShaper
    from tokenfab.server.tool_plan import ToolPlan

    plan = ToolPlan(mode, TOOLS)
    message, reason = HarmonyShaper(plan).final_ids(ids, finish)
    s, deltas = HarmonyShaper(plan), []
    for t in ids:  # one token per delta
        deltas += s.feed_ids([t])
    tail, stream_reason = s.finish(finish)
    deltas += tail
    assert stream_reason == reason
    joined = {"reasoning_content": "".join(d.get("reasoning_content", "") for d in deltas) or None,
              "content": "".join(d.get("content", "") for d in deltas) or None,
              "tool_calls": [tc for d in deltas for tc in d.get("tool_calls", ())]}
    assert all(d.get("reasoning") == d.get("reasoning_content") for d in deltas)
    assert joined["reasoning_content"] == message["reasoning_content"] == message["reasoning"]
    assert joined["content"] == message["content"]
    assert [(tc["type"], tc["function"]) for tc in joined["tool_calls"]] == \
        [(tc["type"], tc["function"]) for tc in message.get("tool_calls", [])]  # ids: random, one per call
    assert [tc["index"] for tc in joined["tool_calls"]] == list(range(len(joined["tool_calls"])))
    return message, reason


def test_analysis_preamble_and_call_become_reasoning_content_and_tool_calls():
    args = '{"city": "Zürich"}'
    ids = _reply(_analysis("Need the tool."), _say("Checking.", "commentary"), _call("get_weather", args))
    message, reason = _shape(ids)
    assert reason == "tool_calls"
    assert (message["reasoning_content"], message["content"]) == ("Need the tool.", "Checking.")
    [call] = message["tool_calls"]
    assert call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"] == {"name": "get_weather", "arguments": args}


def test_final_answer_without_a_call():
    message, reason = _shape(_reply(_analysis("Easy."), _say("It is 3 °C.")))
    assert reason == "stop" and "tool_calls" not in message
    assert (message["reasoning_content"], message["content"]) == ("Easy.", "It is 3 °C.")


def test_two_calls_get_indexes_in_order():
    ids = _reply(_call("get_weather", '{"city": "Paris"}'), _call("get_weather", '{"city": "Zürich"}'))
    message, reason = _shape(ids)
    assert reason == "tool_calls"
    assert [json.loads(c["function"]["arguments"])["city"] for c in message["tool_calls"]] == ["Paris", "Zürich"]


@pytest.mark.parametrize("name,args", [
    ("get_weather", '{"city": "Lima"}'),  # not in the enum: fails the schema
    ("get_weather", '{"city": "Paris", "extra": 1}'),  # additionalProperties false
    ("get_weather", '["Paris"]'),  # not an object
    ("get_weather", 'city="Paris"'),  # not JSON
    ("unknown_tool", '{"city": "Paris"}'),  # not one of the request's tools
])
def test_call_failing_its_schema_is_content(name, args):
    message, reason = _shape(_reply(_analysis("Hm."), _call(name, args)))
    assert reason == "stop" and "tool_calls" not in message
    assert message["content"] == args and message["reasoning_content"] == "Hm."


def test_cut_off_call_is_content_and_tool_choice_none_keeps_calls_as_content():
    ids = _reply(_analysis("Hm."), _call("get_weather", '{"city": "Zürich"}'))
    message, reason = _shape(ids[:-3], finish="length")  # cut inside the arguments
    assert reason == "length" and "tool_calls" not in message and message["content"].startswith('{"city"')
    message, reason = _shape(ids, mode="none")
    assert reason == "stop" and "tool_calls" not in message and message["content"] == '{"city": "Zürich"}'


def test_malformed_token_sequence_is_content_never_an_error():
    from tokenfab.server.reasoning.harmony_vocab import harmony_encoding

    enc = harmony_encoding()
    ids = enc.encode("<|message|><|channel|>no header here<|end|>", allowed_special="all")
    message, reason = _shape(ids)
    assert reason == "stop" and message["content"] and "tool_calls" not in message


# ---- live: a tiny random GPT-OSS model behind the real server ----

@pytest.fixture(scope="module")
def gpt_oss_client(tmp_path_factory):
    from tests.server.conftest import LiveServer
    from tests.server.harmony_model import save_tiny_gpt_oss
    from tokenfab import LLM
    from tokenfab.engine.core.async_engine import AsyncEngine
    from tokenfab.server.app import ServerConfig, build_app

    path = save_tiny_gpt_oss(tmp_path_factory.mktemp("gpt_oss"))
    llm = LLM(model=str(path), max_model_len=512)
    server = LiveServer(build_app(AsyncEngine(llm.engine), ServerConfig(drain_timeout=5)))
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    server.stop()


def test_live_prompt_is_harmony_with_the_reasoning_effort(gpt_oss_client):
    from tokenfab.server.reasoning.harmony_prompt import render_gpt_oss_prompt
    from tokenfab.server.reasoning.harmony_vocab import harmony_encoding

    for effort in ("low", "high"):
        r = gpt_oss_client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, max_tokens=4,
                                                   temperature=0.0, reasoning_effort=effort,
                                                   extra_body={"prompt_logprobs": 0})
        prompt = [None] + [int(next(iter(lp))) for lp in r.model_extra["prompt_logprobs"][1:]]
        want = render_gpt_oss_prompt(ASK, TOOLS, effort)
        assert r.usage.prompt_tokens == len(want) and prompt[1:] == want[1:]
        assert f"Reasoning: {effort}" in harmony_encoding().decode(want)
        assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("kw,param", [
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"extra_body": {"continue_final_message": True, "add_generation_prompt": False}}, "continue_final_message"),
    ({"messages": [*ASK, {"role": "tool", "tool_call_id": "call_x", "content": "1"}]}, "messages"),  # no such call
])
def test_live_bad_requests_are_400(gpt_oss_client, kw, param):
    with pytest.raises(openai.BadRequestError) as e:
        gpt_oss_client.chat.completions.create(model=None, **{"messages": ASK, "max_tokens": 4, **kw})
    assert e.value.body["param"] == param, e.value.body


def test_live_required_single_call_validates(gpt_oss_client):
    r = gpt_oss_client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, tool_choice="required",
                                               parallel_tool_calls=False, max_tokens=40, temperature=0.0)
    assert r.choices[0].finish_reason == "tool_calls"
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)


def _stream(client, **kw) -> tuple[dict, str | None]:
    msg = {"content": "", "reasoning_content": "", "tool_calls": {}}
    finish = None
    for chunk in client.chat.completions.create(model=None, stream=True, **kw):
        for ch in chunk.choices:
            msg["content"] += ch.delta.content or ""
            msg["reasoning_content"] += (ch.delta.model_extra or {}).get("reasoning_content") or ""
            for tc in ch.delta.tool_calls or ():
                call = msg["tool_calls"].setdefault(tc.index, {"name": tc.function.name, "arguments": ""})
                call["arguments"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return msg, finish


def test_live_streamed_equals_non_streamed(gpt_oss_client):
    kw = dict(messages=ASK, tools=TOOLS, max_tokens=24, temperature=0.0, reasoning_effort="low")
    r = gpt_oss_client.chat.completions.create(model=None, **kw)
    streamed, finish = _stream(gpt_oss_client, **kw)
    m = r.choices[0].message
    assert finish == r.choices[0].finish_reason
    assert streamed["content"] == (m.content or "")
    assert streamed["reasoning_content"] == (m.model_extra.get("reasoning_content") or "")
    assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"].values()] == [
        (c.function.name, c.function.arguments) for c in m.tool_calls or ()]


def test_live_named_tool_validates_streamed_and_not_then_a_tool_turn(gpt_oss_client):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    kw = dict(messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=40, temperature=0.0)
    r = gpt_oss_client.chat.completions.create(model=None, **kw)
    assert r.choices[0].finish_reason == "tool_calls"
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER)
    streamed, finish = _stream(gpt_oss_client, **kw)
    assert finish == "tool_calls"
    assert [(c["name"], c["arguments"]) for c in streamed["tool_calls"].values()] == [
        ("get_weather", call.function.arguments)]
    messages = [*ASK, r.choices[0].message.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 3}'}]
    r2 = gpt_oss_client.chat.completions.create(model=None, messages=messages, tools=TOOLS, max_tokens=8,
                                                temperature=0.0)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r2.usage.prompt_tokens > r.usage.prompt_tokens


def test_prefilled_final_channel_streams_json_as_content():
    """With a response_format the prompt ends inside a final message (chat_harmony.harmony_prefill): the shaper,
    primed with that prefill, gives the JSON as content token by token."""
    from tokenfab.server.chat_harmony import HarmonyShaper
    from tokenfab.server.reasoning.harmony_vocab import harmony_encoding
    from tokenfab.server.tool_plan import ToolPlan

    ids = harmony_encoding().encode('{"city": "Zürich"}<|return|>', allowed_special="all")
    s = HarmonyShaper(ToolPlan("none"), "<|channel|>final<|message|>")
    deltas = [d for t in ids for d in s.feed_ids([t])] + s.finish("stop")[0]
    assert len(deltas) > 3 and "".join(d["content"] for d in deltas) == '{"city": "Zürich"}'


def test_live_response_format_streams_valid_json_content(gpt_oss_client):
    fmt = {"type": "json_schema", "json_schema": {"name": "w", "schema": WEATHER}}
    kw = dict(messages=ASK, max_tokens=40, temperature=0.0, response_format=fmt)
    r = gpt_oss_client.chat.completions.create(model=None, **kw)
    jsonschema.validate(json.loads(r.choices[0].message.content), WEATHER)
    pieces = [ch.delta.content for chunk in gpt_oss_client.chat.completions.create(model=None, stream=True, **kw)
              for ch in chunk.choices if ch.delta.content]
    assert len(pieces) > 1 and "".join(pieces) == r.choices[0].message.content


def test_gpt_oss_model_folder_selects_harmony(tmp_path):
    """The engine in its own process: the model type comes from config.json, and GPT-OSS goes through Harmony
    unless the request brings its own (trusted) text template."""
    from types import SimpleNamespace

    from tokenfab.server.app import ServerConfig
    from tokenfab.server.chat_harmony import uses_harmony
    from tokenfab.server.model_parsers import parser_names
    from tokenfab.server.protocol import ChatCompletionRequest

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"]}))
    server = SimpleNamespace(engine=SimpleNamespace(), config=ServerConfig(),
                             tokenizer=SimpleNamespace(chat_template="{{ tools }}", name_or_path=str(tmp_path)))
    names = parser_names(server)
    assert names == ("openai", "gpt_oss")
    assert uses_harmony(*names, ChatCompletionRequest.model_validate({"messages": ASK}))
    assert not uses_harmony(*names, ChatCompletionRequest.model_validate({"messages": ASK, "chat_template": "x"}))
