"""Tools in /v1/chat/completions, end to end on the bundled model with the official openai client (the live
in-process server of conftest.py), plus unit tests of chat_tools' output shaping.

The bundled SmolLM2 was never trained on tools: `required` and a named tool_choice must still return calls
whose arguments validate against the tool's schema, because xgrammar constrains the decoding."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from tokenfab.server.chat_tools import ChoiceShaper
from tokenfab.server.reasoning import get_reasoning_parser
from tokenfab.server.tool_plan import ToolPlan

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                   "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": ADD,
                                      "strict": True}},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_calls(calls: list) -> None:
    assert calls
    for c in calls:
        assert c.id.startswith("call_") and c.type == "function"
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])


@pytest.mark.parametrize("parallel", [True, False])
def test_required_returns_valid_calls(client: openai.OpenAI, parallel: bool) -> None:
    r = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=parallel, max_tokens=120, temperature=0.0)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.content is None
    _check_calls(choice.message.tool_calls)
    if not parallel:
        assert len(choice.message.tool_calls) == 1


def test_named_returns_that_tool(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0.0,
                                       tool_choice={"type": "function", "function": {"name": "add"}})
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert [c.function.name for c in choice.message.tool_calls] == ["add"]
    _check_calls(choice.message.tool_calls)


def _stream_calls(client: openai.OpenAI, **kw) -> tuple[dict[int, dict], str | None, str]:
    calls: dict[int, dict] = {}
    finish = None
    content = ""
    for chunk in client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, stream=True,
                                                temperature=0.0, **kw):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or ():
                if tc.id is not None:  # the first delta of a call: id and name, before any argument
                    assert tc.index not in calls and tc.function.name
                    calls[tc.index] = {"id": tc.id, "name": tc.function.name, "args": tc.function.arguments or ""}
                else:
                    calls[tc.index]["args"] += tc.function.arguments or ""
            finish = ch.finish_reason or finish
    return calls, finish, content


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_streamed_calls_validate(client: openai.OpenAI, choice) -> None:
    calls, finish, content = _stream_calls(client, tool_choice=choice, max_tokens=120)
    assert finish == "tool_calls" and content == ""
    assert calls
    for c in calls.values():
        assert c["id"].startswith("call_")
        jsonschema.validate(json.loads(c["args"]), SCHEMAS[c["name"]])
    if isinstance(choice, dict):
        assert [c["name"] for c in calls.values()] == ["get_weather"]
    # the same request unstreamed gives the same calls (greedy)
    r = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, tool_choice=choice, max_tokens=120,
                                       temperature=0.0)
    assert [(c.function.name, c.function.arguments) for c in r.choices[0].message.tool_calls] == [
        (c["name"], c["args"]) for c in calls.values()]


def test_two_turn_tool_conversation(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=None, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0.0,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    msg = r.choices[0].message
    call = msg.tool_calls[0]
    messages = [*ASK, msg.model_dump(exclude_none=True),
                {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    r2 = client.chat.completions.create(model=None, messages=messages, tools=TOOLS, max_tokens=16,
                                        temperature=0.0)
    assert r2.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert r2.choices[0].message.content or r2.choices[0].message.tool_calls
    # tool_choice none: plain content even with tools
    r3 = client.chat.completions.create(model=None, messages=messages, tools=TOOLS, tool_choice="none",
                                        max_tokens=8, temperature=0.0)
    assert r3.choices[0].message.tool_calls is None and r3.choices[0].message.content


@pytest.mark.parametrize("kw,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
                                                                             "properties": {"x": {"type": 5}}}}}]},
     "tools.0.function.parameters"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}]},
     "tools.0.function.parameters"),
    ({"tools": TOOLS, "messages": [*ASK, {"role": "tool", "content": "21"}]}, "messages.1.tool_call_id"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
])
def test_bad_tool_requests_are_400(client: openai.OpenAI, kw: dict, param: str) -> None:
    kw = {"messages": ASK, **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=None, max_tokens=4, **kw)
    assert e.value.body["param"] == param, e.value.body


# ---- chat_tools unit tests: auto with a parser-triggering output, reasoning ----

TOOL_DICTS = TOOLS


def test_auto_hermes_final_and_stream_agree() -> None:
    out = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lima", "unit": "celsius"}}\n' \
          '</tool_call>'
    plan = ToolPlan("auto", TOOL_DICTS)
    msg, reason = ChoiceShaper(plan, "hermes", None).final(out, "stop")
    assert reason == "tool_calls" and msg["content"] == "Let me check."
    [call] = msg["tool_calls"]
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Lima", "unit": "celsius"}
    s = ChoiceShaper(plan, "hermes", None)
    deltas = [d for ch in out for d in s.feed(ch)]
    tail, reason = s.finish("stop")
    deltas += tail
    assert reason == "tool_calls"
    assert "".join(d.get("content", "") for d in deltas) == "Let me check."
    args = "".join(tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", ()))
    assert args == call["function"]["arguments"]


def test_auto_without_call_is_content() -> None:
    plan = ToolPlan("auto", TOOL_DICTS)
    msg, reason = ChoiceShaper(plan, "hermes", None).final("It is sunny. <tool_call>{\"name\": ", "length")
    assert reason == "length" and "tool_calls" not in msg
    assert msg["content"] == "It is sunny. <tool_call>{\"name\": "


def test_reasoning_split_and_tools_from_content_only() -> None:
    out = '<think>maybe <tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call></think>It is 21C.'
    reasoning = get_reasoning_parser("deepseek_r1")
    plan = ToolPlan("auto", TOOL_DICTS)
    msg, reason = ChoiceShaper(plan, "hermes", reasoning).final(out, "stop")
    assert reason == "stop" and "tool_calls" not in msg
    assert msg["content"] == "It is 21C."
    assert msg["reasoning_content"] == msg["reasoning"] and msg["reasoning_content"].startswith("maybe")
    s = ChoiceShaper(plan, "hermes", get_reasoning_parser("deepseek_r1"))
    deltas = [d for ch in out for d in s.feed(ch)]
    tail, reason = s.finish("stop")
    deltas += tail
    assert reason == "stop"
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content", "") for d in deltas) == "It is 21C."


def test_required_array_stream_with_commas_in_strings() -> None:
    out = ('[{"name":"get_weather","parameters":{"city":"a,]}b","unit":"celsius"}},'
           '{"name":"add","parameters":{"a":1,"b":2}}]')
    plan = ToolPlan("required", TOOL_DICTS, parallel=True)
    msg, reason = ChoiceShaper(plan, None, None).final(out, "stop")
    assert reason == "tool_calls" and msg["content"] is None
    assert [json.loads(c["function"]["arguments"]) for c in msg["tool_calls"]] == [
        {"city": "a,]}b", "unit": "celsius"}, {"a": 1, "b": 2}]
    s = ChoiceShaper(plan, None, None)
    deltas = [d for ch in out for d in s.feed(ch)]
    deltas += s.finish("stop")[0]
    args: dict[int, str] = {}
    for d in deltas:
        assert "content" not in d
        for tc in d["tool_calls"]:
            args[tc["index"]] = args.get(tc["index"], "") + tc["function"]["arguments"]
    assert [args[0], args[1]] == [c["function"]["arguments"] for c in msg["tool_calls"]]


def test_parser_names_by_model_type_and_flags() -> None:
    from types import SimpleNamespace

    from tokenfab.server.app import ServerConfig
    from tokenfab.server.model_parsers import parser_names

    def server(model_type: str, template: str, **flags) -> SimpleNamespace:
        engine = SimpleNamespace(engine=SimpleNamespace(config={"model_type": model_type, "architectures": []}))
        return SimpleNamespace(engine=engine, tokenizer=SimpleNamespace(chat_template=template),
                               config=ServerConfig(**flags))

    assert parser_names(server("qwen3", "{% if tools %}<tool_call>{% endif %}")) == ("hermes", "qwen3")
    assert parser_names(server("llama", "{{ messages }}")) == ("hermes", None)  # no tool format: Hermes
    assert parser_names(server("llama", "{% if tools %}{% endif %}")) == ("llama3_json", None)
    assert parser_names(server("llama", "x", tool_call_parser="kimi_k2", reasoning_parser="deepseek_r1")) == (
        "kimi_k2", "deepseek_r1")


def test_parser_names_from_the_model_folder_when_the_engine_is_remote(tmp_path) -> None:
    from types import SimpleNamespace

    from tokenfab.server.app import ServerConfig
    from tokenfab.server.model_parsers import parser_names

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"]}))
    server = SimpleNamespace(engine=SimpleNamespace(),  # EngineCoreClient: no in-process model config
                             tokenizer=SimpleNamespace(chat_template="{{ tools }}", name_or_path=str(tmp_path)),
                             config=ServerConfig())
    assert parser_names(server) == ("hermes", "qwen3")


def test_tools_and_tool_turns_reach_the_template() -> None:
    from tokenfab.engine.core.client import load_tokenizer
    from tokenfab.server.chat_template import render_chat
    from tokenfab.server.protocol import ChatCompletionRequest

    template = ("{% for t in tools %}[tool {{ t.function.name }}]{% endfor %}"
                "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
                "{% for c in m.tool_calls or [] %}(call {{ c.id }} {{ c.function.name }} "
                "a={{ c.function.arguments.a }})"
                "{% endfor %}{% if m.tool_call_id %}(result of {{ m.tool_call_id }}){% endif %}{% endfor %}")
    body = ChatCompletionRequest.model_validate({"messages": [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 3, "b": 4}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "7"},
    ]})
    text = render_chat(load_tokenizer(None), body.messages, add_generation_prompt=False,
                       kwargs={"tools": TOOLS}, chat_template=template)
    assert text == ("[tool get_weather][tool add]<user>What is the weather in Paris?"
                    "<assistant>(call call_1 add a=3)<tool>7(result of call_1)")


def _shape_both(plan: ToolPlan, parser: str, out: str, finish: str = "stop"):
    """(final message, reason) and the streamed deltas (1-character feeds) with their reason."""
    msg, reason = ChoiceShaper(plan, parser, None).final(out, finish)
    s = ChoiceShaper(plan, parser, None)
    deltas = [d for ch in out for d in s.feed(ch)]
    tail, sreason = s.finish(finish)
    return msg, reason, deltas + tail, sreason


@pytest.mark.parametrize("args", [
    '{"city": "Berlin", "unit": "celsius"}',  # not in the enum
    '{"city": "Lima"}',  # a required property missing
    '{"city": "Lima", "unit": "celsius", "x": 1}',  # additionalProperties: false
])
def test_auto_call_failing_its_schema_is_content(args: str) -> None:
    call = f'<tool_call>\n{{"name": "get_weather", "arguments": {args}}}\n</tool_call>'
    out = "Let me check.\n" + call
    msg, reason, deltas, sreason = _shape_both(ToolPlan("auto", TOOL_DICTS), "hermes", out)
    assert reason == sreason == "stop" and "tool_calls" not in msg and msg["content"] == out
    assert not any("tool_calls" in d for d in deltas)
    assert "".join(d["content"] for d in deltas) == "Let me check." + call  # the call's own text, as content


def test_auto_unknown_tool_name_is_content_and_valid_calls_stream_whole() -> None:
    plan = ToolPlan("auto", TOOL_DICTS)
    out = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
    msg, reason, deltas, _ = _shape_both(plan, "hermes", out)
    assert "tool_calls" not in msg and msg["content"] == out and "".join(d["content"] for d in deltas) == out
    # two valid calls then text: each call is one delta (id, name, whole arguments), indexes 0 and 1
    calls = ['{"name": "add", "arguments": {"a": 1, "b": 2}}', '{"name": "add", "arguments": {"a": 3, "b": 4}}']
    out = "".join(f"<tool_call>{c}</tool_call>" for c in calls)
    msg, reason, deltas, sreason = _shape_both(plan, "hermes", out)
    assert reason == sreason == "tool_calls"
    sent = [tc for d in deltas for tc in d["tool_calls"]]
    assert [(tc["index"], tc["function"]["name"], tc["function"]["arguments"]) for tc in sent] == [
        (0, "add", '{"a": 1, "b": 2}'), (1, "add", '{"a": 3, "b": 4}')]
    assert [c["function"]["arguments"] for c in msg["tool_calls"]] == [tc["function"]["arguments"] for tc in sent]


def test_auto_cut_off_call_streams_as_content() -> None:
    out = 'Sure. <tool_call>{"name": "add", "arguments": {"a": 1, '
    msg, reason, deltas, sreason = _shape_both(ToolPlan("auto", TOOL_DICTS), "hermes", out, "length")
    assert reason == sreason == "length" and msg["content"] == out
    assert not any("tool_calls" in d for d in deltas)
    assert "".join(d["content"] for d in deltas) == "Sure." + out[len("Sure. "):]  # the space before a call: dropped


def test_strict_tools_in_auto_get_a_structural_tag_for_fixed_header_families() -> None:
    from tokenfab.server.chat_grammar import strict_tag_format

    plan = ToolPlan("auto", TOOL_DICTS)  # "add" is strict, "get_weather" is not
    fmt = strict_tag_format(plan, "hermes")
    assert fmt is not None and fmt.triggers == ["<tool_call>"]
    assert fmt.structures == [
        {"begin": '<tool_call>\n{"name": "get_weather", "arguments": ', "end": "}\n</tool_call>",
         "schema": {"type": "object"}},
        {"begin": '<tool_call>\n{"name": "add", "arguments": ', "end": "}\n</tool_call>", "schema": ADD}]
    assert strict_tag_format(plan, "kimi_k2") is None and strict_tag_format(plan, "glm45") is None
    assert strict_tag_format(ToolPlan("required", TOOL_DICTS), "hermes") is None
    assert strict_tag_format(ToolPlan("auto", [TOOL_DICTS[0]]), "hermes") is None  # no strict tool


@pytest.mark.parametrize("family,call", [
    ("hermes", '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'),
    ("deepseek_v31", '<｜tool▁call▁begin｜>add<｜tool▁sep｜>{"a": 1, "b": 2}<｜tool▁call▁end｜>'),
    ("deepseek_v3",
     '<｜tool▁call▁begin｜>function<｜tool▁sep｜>add\n```json\n{"a": 1, "b": 2}\n```<｜tool▁call▁end｜>'),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": 2}}'),
])
def test_strict_tag_grammar_passes_text_and_valid_calls_only(family: str, call: str) -> None:
    """The structural tag compiled by the engine's StructuredOutputCompiler (bundled tokenizer): free text and a
    valid call are accepted; once a call starts, an unknown name or arguments off the strict schema are not."""
    from tokenfab.engine.core.client import load_tokenizer
    from tokenfab.engine.runner.structured import StructuredOutputCompiler
    from tokenfab.server.chat_grammar import strict_tag_format
    from tokenfab.server.tools import get_tool_parser

    spec = strict_tag_format(ToolPlan("auto", TOOL_DICTS), family).model_dump()
    compiler = StructuredOutputCompiler(load_tokenizer(None))

    def accepts(text: str) -> bool:
        return compiler.from_response_format(spec)._matcher.accept_string(text)

    assert accepts("Let me see. " + call)
    assert [(c.name, json.loads(c.arguments_json)) for c in get_tool_parser(family).extract(call).calls] == [
        ("add", {"a": 1, "b": 2})]  # what the grammar allows is what the parser reads
    assert not accepts(call.replace('"b": 2', '"b": 200'))  # maximum 99
    assert not accepts(call.replace(', "b": 2', ""))  # "b" required
    assert not accepts(call.replace("add", "sub"))  # not a tool
    loose = call.replace('"a": 1, "b": 2', '"city": "Oslo", "x": [1]').replace("add", "get_weather")
    assert accepts(loose)  # get_weather is not strict: any object


def test_strict_tools_leave_plain_answers_unchanged(client: openai.OpenAI) -> None:
    """Live: with a strict tool the grammar is on, and a greedy answer that calls nothing is the same as with
    the tool non-strict (the structural tag lets text through until a call marker)."""
    strict = [{"type": "function", "function": {**TOOLS[1]["function"], "strict": True}}]
    loose = [{"type": "function", "function": {**TOOLS[1]["function"], "strict": False}}]
    answers = [client.chat.completions.create(model=None, messages=ASK, tools=tools, max_tokens=12,
                                              temperature=0.0).choices[0] for tools in (strict, loose)]
    assert answers[0].message.content == answers[1].message.content and answers[0].message.content
    assert answers[0].finish_reason == answers[1].finish_reason


def test_strict_tools_without_grammar_support_still_answer() -> None:
    """A tokenizer xgrammar cannot use (the fake engine's byte tokenizer): strict tools in auto mode are then
    not grammar-enforced, and the request is still served (the jsonschema check stays)."""
    from tests.server.inprocess import fake_server

    with fake_server() as (http, _):
        r = http.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "max_tokens": 4})
        assert r.status_code == 200, r.text
        r = http.post("/v1/chat/completions", json={"messages": ASK, "tools": TOOLS, "tool_choice": "required",
                                                    "max_tokens": 4})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"  # required needs it
