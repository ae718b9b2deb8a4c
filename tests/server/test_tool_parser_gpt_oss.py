"""GPT-OSS tool calls through Harmony (tokenfab/server/tools/gpt_oss.py), on texts written in the Harmony
format and on token ids rendered by openai-harmony itself."""

from __future__ import annotations

import json
import random

import pytest

from tests.server.harmony_skip import skip_without_harmony_vocab

pytestmark = skip_without_harmony_vocab()

ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant"
ARGS = '{"city": "Zürich 🌧", "options": {"units": ["c", "f"], "days": 3, "nested": {"a": null}}}'
CALL = f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{ARGS}<|call|>"


def _calls(parsed):
    ids = [c.id for c in parsed.calls]
    assert all(i.startswith("call_") and len(i) == 29 for i in ids) and len(set(ids)) == len(ids)
    return [(c.name, c.arguments_json) for c in parsed.calls]


def _streamed(text: str, sizes: list[int]):
    from tokenfab.server.tools.base import ToolCallDelta
    from tokenfab.server.tools.gpt_oss import GptOssToolParser, collect

    s, events, i, k = GptOssToolParser().stream(), [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        events += s.feed(text[i : i + n])
        i, k = i + n, k + 1
    events += s.finish()
    assert [d.index for d in events if isinstance(d, ToolCallDelta)] == list(range(len(collect(events).calls)))
    return collect(events)


def check(text: str, reasoning, content, calls) -> None:
    from tokenfab.server.tools.gpt_oss import GptOssToolParser

    for parsed in [GptOssToolParser().extract(text), _streamed(text, [1]),
                   _streamed(text, [random.Random(7).randint(1, 9) for _ in range(11)])]:
        assert (parsed.reasoning, parsed.content, _calls(parsed)) == (reasoning, content, calls)


def test_one_call_after_reasoning_with_unicode_nested_arguments():
    check(ANALYSIS + CALL, "The user wants the weather.", None, [("get_weather", ARGS)])
    assert json.loads(ARGS)["options"]["nested"] == {"a": None}


def test_content_before_the_call():
    """A preamble on the commentary channel is content; the call follows it."""
    text = ANALYSIS + "<|channel|>commentary<|message|>Let me check.<|end|><|start|>assistant" + CALL
    check(text, "The user wants the weather.", "Let me check.", [("get_weather", ARGS)])


def test_parallel_calls():
    second = '<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"tz": "Europe/Zurich"}<|call|>'
    check(ANALYSIS + CALL + "<|start|>assistant" + second, "The user wants the weather.", None,
          [("get_weather", ARGS), ("get_time", '{"tz": "Europe/Zurich"}')])


def test_call_cut_off_mid_arguments_is_content():
    text = ANALYSIS + CALL[: CALL.index('"days"')]
    check(text, "The user wants the weather.", ARGS[: ARGS.index('"days"')], [])


def test_malformed_arguments_are_content():
    text = ANALYSIS + "<|channel|>commentary to=functions.get_weather<|message|>city=Paris<|call|>"
    check(text, "The user wants the weather.", "city=Paris", [])


def test_final_answer_without_tools():
    check(ANALYSIS + "<|channel|>final<|message|>It rains.<|return|>", "The user wants the weather.",
          "It rains.", [])


def test_round_trip_conversation_with_tools_and_results():
    """System (reasoning effort) + developer (tools) + user + call + tool result, rendered by openai-harmony;
    the model's next reply (analysis, then a second call) rendered the same way parses back from token ids."""
    from openai_harmony import (
        Author,
        Conversation,
        DeveloperContent,
        Message,
        ReasoningEffort,
        Role,
        SystemContent,
        ToolDescription,
    )

    from tokenfab.server.reasoning.harmony_vocab import harmony_encoding
    from tokenfab.server.tools.gpt_oss import GptOssToolParser, collect

    enc = harmony_encoding()
    tool = ToolDescription.new("get_weather", "Weather", parameters={
        "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})

    def call(args: str) -> Message:
        return (Message.from_role_and_content(Role.ASSISTANT, args).with_channel("commentary")
                .with_recipient("functions.get_weather").with_content_type("<|constrain|>json"))

    history = [
        Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_reasoning_effort(ReasoningEffort.LOW)),
        Message.from_role_and_content(Role.DEVELOPER, DeveloperContent.new().with_function_tools([tool])),
        Message.from_role_and_content(Role.USER, "Weather in Zürich, then Bern?"),
        call('{"city": "Zürich"}'),
        Message.from_author_and_content(Author.new(Role.TOOL, "functions.get_weather"), '{"temp": 3}')
        .with_channel("commentary").with_recipient("assistant"),
    ]
    prompt = enc.render_conversation_for_completion(Conversation.from_messages(history), Role.ASSISTANT)
    assert "get_weather" in enc.decode(prompt) and enc.decode(prompt).endswith("<|start|>assistant")
    reply = [Message.from_role_and_content(Role.ASSISTANT, "Now Bern.").with_channel("analysis"),
             call('{"city": "Bern"}')]
    head = enc.encode("<|start|>assistant", allowed_special="all")
    ids = [t for m in reply for t in enc.render(m)][len(head) :]
    expected = ("Now Bern.", None, [("get_weather", '{"city": "Bern"}')])
    parsed = GptOssToolParser().extract_ids(ids)
    assert (parsed.reasoning, parsed.content, _calls(parsed)) == expected
    s, events = GptOssToolParser().stream(), []
    for t in ids:
        events += s.feed_ids([t])
    parsed = collect(events + s.finish())
    assert (parsed.reasoning, parsed.content, _calls(parsed)) == expected


def test_registry():
    from tokenfab.server.tools import get_tool_parser, tool_parser_for_model
    from tokenfab.server.tools.gpt_oss import GptOssToolParser

    assert tool_parser_for_model("gpt_oss") == "openai"
    parsed = get_tool_parser("openai").extract(ANALYSIS + CALL)
    assert isinstance(get_tool_parser("openai"), GptOssToolParser) and _calls(parsed) == [("get_weather", ARGS)]


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_prompt_from_openai_messages_with_tools_and_results():
    """OpenAI chat messages (system, user, an assistant tool call with reasoning, the tool's result) rendered by
    openai-harmony: effort in the system message, instructions and tools in the developer message, the call on
    commentary to=functions.NAME, the result from functions.NAME; then the reply parses back."""
    from tokenfab.server.reasoning.harmony_prompt import gpt_oss_stop_token_ids, render_gpt_oss_prompt
    from tokenfab.server.reasoning.harmony_vocab import harmony_encoding
    from tokenfab.server.tools.gpt_oss import GptOssToolParser

    enc = harmony_encoding()
    msgs = [{"role": "system", "content": "Be brief."},
            {"role": "user", "content": [{"type": "text", "text": "Weather in Zürich?"}]},
            {"role": "assistant", "content": None, "reasoning_content": "Need the tool.", "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": '{"city": "Zürich"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 3}'}]
    text = enc.decode(render_gpt_oss_prompt(msgs, [WEATHER_TOOL], "high"))
    for part in ["<|start|>system<|message|>", "Reasoning: high", "<|start|>developer<|message|># Instructions\n\n"
                 "Be brief.", "type get_weather = (_: {\ncity: string,\n}) => any;",
                 "<|start|>user<|message|>Weather in Zürich?<|end|>",
                 "<|start|>assistant<|channel|>analysis<|message|>Need the tool.<|end|>",
                 '<|start|>assistant to=functions.get_weather<|channel|>commentary <|constrain|>json<|message|>'
                 '{"city": "Zürich"}<|call|>',
                 '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"temp": 3}<|end|>']:
        assert part in text, part
    assert text.endswith("<|start|>assistant")
    assert enc.decode(gpt_oss_stop_token_ids()) in ("<|return|><|call|>", "<|call|><|return|>")
    # The model's next turn, written in Harmony, parses back: analysis -> reasoning, final -> content.
    parsed = GptOssToolParser().extract("<|channel|>analysis<|message|>3 degrees.<|end|><|start|>assistant"
                                        "<|channel|>final<|message|>It is 3 °C.<|return|>")
    assert (parsed.reasoning, parsed.content, parsed.calls) == ("3 degrees.", "It is 3 °C.", [])


@pytest.mark.parametrize(("messages", "tools", "effort", "match"), [
    ([{"role": "tool", "tool_call_id": "call_x", "content": "1"}], None, None, "matches no earlier"),
    ([{"role": "user", "content": "hi"}], None, "extreme", "reasoning_effort"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}], None, None, "text"),
    ([{"role": "user", "content": "hi"}], [{"type": "function"}], None, "tools"),
    ([{"role": "wizard", "content": "hi"}], None, None, "unknown role"),
])
def test_prompt_bad_input_is_a_value_error(messages, tools, effort, match):
    from tokenfab.server.reasoning.harmony_prompt import render_gpt_oss_prompt

    with pytest.raises(ValueError, match=match):
        render_gpt_oss_prompt(messages, tools, effort)
