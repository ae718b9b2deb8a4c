"""Tool-call parsers per family, on fixed texts written from each family's published format.

Each family has a writer that renders calls the way the model's chat template renders an assistant turn with
tool calls; the parser must read back the same names and arguments (compared as decoded JSON, an independent
reference), keep content before the call, return a cut-off or malformed call as content, and stream in any
split (1-character deltas and random split points) to exactly what `extract` returns.
"""

from __future__ import annotations

import json

import jinja2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfab.server.tools import (
    TOOL_PARSERS,
    ContentDelta,
    ExtractedToolCalls,
    ToolCallDelta,
    assemble,
    get_tool_parser,
    tool_parser_for_model,
)


def _hermes(calls: list[tuple[str, dict]]) -> str:
    return "\n".join(
        f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n</tool_call>" for n, a in calls
    )


def _llama3(calls: list[tuple[str, dict]]) -> str:
    return "<|python_tag|>" + "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls)


def _deepseek_v3(calls: list[tuple[str, dict]]) -> str:
    body = "\n".join(
        f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n{json.dumps(a, ensure_ascii=False)}\n```"
        "<｜tool▁call▁end｜>"
        for n, a in calls
    )
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def _deepseek_v31(calls: list[tuple[str, dict]]) -> str:
    body = "".join(
        f"<｜tool▁call▁begin｜>{n}<｜tool▁sep｜>{json.dumps(a, ensure_ascii=False)}<｜tool▁call▁end｜>"
        for n, a in calls
    )
    return f"<｜tool▁calls▁begin｜>{body}<｜tool▁calls▁end｜>"


def _kimi_k2(calls: list[tuple[str, dict]]) -> str:
    body = "".join(
        f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{json.dumps(a, ensure_ascii=False)}"
        "<|tool_call_end|>"
        for i, (n, a) in enumerate(calls)
    )
    return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"


def _glm_value(v: object) -> str:
    return v if isinstance(v, str) else json.dumps(v, ensure_ascii=False)


def _glm45(calls: list[tuple[str, dict]]) -> str:
    return "".join(
        f"<tool_call>{n}\n"
        + "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{_glm_value(v)}</arg_value>\n" for k, v in a.items())
        + "</tool_call>"
        for n, a in calls
    )


def _gigachat3(calls: list[tuple[str, dict]]) -> str:
    (n, a) = calls
    return "function call<|role_sep|>\n" + json.dumps({"name": n, "arguments": a}, ensure_ascii=False)


WRITERS = {
    "hermes": _hermes,
    "llama3_json": _llama3,
    "deepseek_v3": _deepseek_v3,
    "deepseek_v31": _deepseek_v31,
    "kimi_k2": _kimi_k2,
    "glm45": _glm45,
    "gigachat3": lambda calls: _gigachat3(calls[0]) if len(calls) == 1 else pytest.skip("one call per message"),
}
PARALLEL = [f for f in WRITERS if f != "gigachat3"]  # GigaChat3 writes one call per message

WEATHER = ("get_weather", {"city": "Paris", "unit": "celsius"})
SEARCH = ("search", {"query": "tokenfab", "limit": 3})
NESTED = (
    "plan_trip",
    {
        "city": "Zürich → 東京 🌧",
        "note": 'say "hi", path C:\\tmp\\{x}',
        "stops": [{"name": "Ёлки", "days": 2, "tags": ["a", "b"]}, {"name": "x", "opts": {"deep": [1, {"y": None}]}}],
        "flag": True,
    },
)
CONTENT = "Let me check that for you."


def _expected(parser_name: str, calls: list[tuple[str, dict]]) -> list[tuple[str, dict]]:
    return calls


def _calls(result) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments_json)) for c in result.calls]


def _stream(parser, pieces: list[str]):
    state = parser.stream()
    deltas = []
    for p in pieces:
        deltas += state.feed(p)
    deltas += state.finish()
    return deltas


def _same(a, b) -> None:
    assert a.content == b.content
    assert [(c.name, c.arguments_json) for c in a.calls] == [(c.name, c.arguments_json) for c in b.calls]


def test_registry_names_match_vllm_and_unknown_is_a_clear_error():
    assert set(TOOL_PARSERS) == set(WRITERS)
    for name in TOOL_PARSERS:
        assert get_tool_parser(name).name == name
    with pytest.raises(ValueError, match="unknown tool-call parser 'nope'.*hermes"):
        get_tool_parser("nope")


def test_parser_chosen_by_model_type_and_template():
    assert tool_parser_for_model("qwen3") == "hermes"
    assert tool_parser_for_model("qwen2", ["Qwen2ForCausalLM"]) == "hermes"
    assert tool_parser_for_model("kimi_k25") == "kimi_k2"
    assert tool_parser_for_model("glm4_moe") == "glm45"
    assert tool_parser_for_model("deepseek_v3") == "deepseek_v31"
    assert tool_parser_for_model("deepseek_v3", chat_template="{{'function<｜tool▁sep｜>' + name}}") == "deepseek_v3"
    assert tool_parser_for_model("deepseek_v3", chat_template="{{ 'function call<|role_sep|>\\n' }}") == "gigachat3"
    assert tool_parser_for_model("gpt2") is None


@pytest.mark.parametrize("family", list(WRITERS))
def test_one_call(family):
    parser = get_tool_parser(family)
    out = parser.extract(WRITERS[family]([WEATHER]))
    assert out.content is None
    assert _calls(out) == [WEATHER]
    if family == "kimi_k2":
        assert out.calls[0].id == "functions.get_weather:0"
    else:
        assert out.calls[0].id.startswith("call_") and len(out.calls[0].id) > 10


@pytest.mark.parametrize("family", PARALLEL)
def test_parallel_calls(family):
    out = get_tool_parser(family).extract(WRITERS[family]([WEATHER, SEARCH, NESTED]))
    assert out.content is None
    assert _calls(out) == [WEATHER, SEARCH, NESTED]
    assert len({c.id for c in out.calls}) == 3


@pytest.mark.parametrize("family", list(WRITERS))
def test_unicode_and_nested_arguments(family):
    out = get_tool_parser(family).extract(WRITERS[family]([NESTED]))
    assert _calls(out) == [NESTED]


@pytest.mark.parametrize("family", list(WRITERS))
def test_content_before_the_call(family):
    out = get_tool_parser(family).extract(CONTENT + "\n\n" + WRITERS[family]([WEATHER]))
    assert out.content == CONTENT
    assert _calls(out) == [WEATHER]


@pytest.mark.parametrize("family", list(WRITERS))
def test_plain_text_is_content_unchanged(family):
    text = "No tools needed: 2 < 3 and {braces} stay.\n"
    parser = get_tool_parser(family)
    assert parser.extract(text).content == text and parser.extract(text).calls == []
    _same(assemble(_stream(parser, list(text))), parser.extract(text))


@pytest.mark.parametrize("family", list(WRITERS))
def test_cut_off_call_is_returned_as_content(family):
    full = CONTENT + " " + WRITERS[family]([NESTED])
    cut = full[: full.index("Ёлки")]  # mid-arguments
    parser = get_tool_parser(family)
    out = parser.extract(cut)
    assert out.content == cut and out.calls == []
    # streaming never raises; the content before the call came through as content
    streamed = assemble(_stream(parser, list(cut)))
    assert (streamed.content or "").startswith(CONTENT)


@pytest.mark.parametrize(
    ("family", "text"),
    [
        ("hermes", '<tool_call>\n{"name": "f", "arguments": {bad json}}\n</tool_call>'),
        ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),
        ("hermes", '<tool_call>\n{"name": "f", "arguments": {}} trailing\n</tool_call>'),
        ("llama3_json", '{"answer": 42}'),
        ("llama3_json", '{"name": "f", "parameters": {"a": 1}} and then prose'),
        ("deepseek_v31", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{'a': 1}<｜tool▁call▁end｜>"),
        ("deepseek_v3", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\nno fence<｜tool▁call▁end｜>"),
        ("kimi_k2", "<|tool_call_begin|>functions.f:0 no argument marker<|tool_call_end|>"),
        ("gigachat3", 'function call<|role_sep|>\n{"name": "f", "arguments": [1, 2]}'),
    ],
)
def test_malformed_call_is_returned_as_content(family, text):
    out = get_tool_parser(family).extract(text)
    assert out.content == text and out.calls == []
    # a call broken before its name was known never shows as a call: the stream gives the text back too
    # (one whose name had streamed cannot be retracted; see tools/base.py)
    deltas = _stream(get_tool_parser(family), list("Hi.\n" + text + " after"))
    if not any(isinstance(d, ToolCallDelta) for d in deltas):
        _same(assemble(deltas), ExtractedToolCalls(content="Hi.\n" + text + " after"))
    else:
        assert '"name": "f"' in text or "<｜tool▁sep｜>" in text  # only where the name came first


@pytest.mark.parametrize(
    ("family", "text"),
    [
        ("hermes", '<tool_call>{"\\q": 1}</tool_call>'),  # invalid escape in a key
        ("hermes", '<tool_call>{"name": "\\q", "arguments": {}}</tool_call>'),
        ("llama3_json", '{"name": "f", "parameters": {}}<|python_tag|>{"name": "g", "parameters": {}}'),
    ],
)
def test_found_by_fuzzing_bad_escapes_and_llama3_tag_after_a_call(family, text):
    parser = get_tool_parser(family)
    assert parser.extract(text) == parser.extract(text) and parser.extract(text).calls == []
    assert parser.extract(text).content == text
    assemble(_stream(parser, list(text)))  # never raises


def test_glm_values_json_decoded_when_valid_else_strings():
    text = (
        "<tool_call>f\n<arg_key>n</arg_key>\n<arg_value>3</arg_value>\n<arg_key>s</arg_key>\n"
        '<arg_value>hello world</arg_value>\n<arg_key>o</arg_key>\n<arg_value>{"k": [1]}</arg_value>\n</tool_call>'
    )
    out = get_tool_parser("glm45").extract(text)
    assert _calls(out) == [("f", {"n": 3, "s": "hello world", "o": {"k": [1]}})]
    # GLM-4.7 / GLM-5 write no newlines; a call without arguments gives {}
    out = get_tool_parser("glm45").extract("<tool_call>g<arg_key>a</arg_key><arg_value>x</arg_value></tool_call>")
    assert _calls(out) == [("g", {"a": "x"})]
    assert _calls(get_tool_parser("glm45").extract("<tool_call>now\n</tool_call>")) == [("now", {})]


def test_glm_string_parameters_follow_the_tool_schema():
    tools = [
        {
            "type": "function",
            "function": {
                "name": "ship",
                "parameters": {
                    "type": "object",
                    "properties": {"zip": {"type": "string"}, "count": {"type": "integer"}},
                },
            },
        }
    ]
    text = (
        "<tool_call>ship\n<arg_key>zip</arg_key>\n<arg_value>01234</arg_value>\n"
        "<arg_key>count</arg_key>\n<arg_value>2</arg_value>\n</tool_call>"
    )
    assert _calls(get_tool_parser("glm45", tools=tools).extract(text)) == [("ship", {"zip": "01234", "count": 2})]
    text = text.replace("01234", "true")
    assert _calls(get_tool_parser("glm45", tools=tools).extract(text)) == [("ship", {"zip": "true", "count": 2})]
    assert _calls(get_tool_parser("glm45").extract(text)) == [("ship", {"zip": True, "count": 2})]


@pytest.mark.parametrize("family", [f for f in PARALLEL if f != "llama3_json"])  # Llama-3: calls are the whole output
def test_text_between_and_after_calls_is_content(family):
    one, two = WRITERS[family]([WEATHER]), WRITERS[family]([SEARCH])
    text = f"First.\n{one}\nThen.  {two}\nDone."
    parser = get_tool_parser(family)
    out = parser.extract(text)
    assert out.content == "First.\nThen.\nDone." and _calls(out) == [WEATHER, SEARCH]
    _same(assemble(_stream(parser, list(text))), out)


def test_llama3_without_python_tag_and_gigachat31_marker():
    text = json.dumps({"name": "f", "parameters": {"a": 1}}) + "; " + json.dumps({"name": "g", "arguments": {}})
    assert _calls(get_tool_parser("llama3_json").extract(text)) == [("f", {"a": 1}), ("g", {})]
    text = 'ok<|function_call|>{"name": "f", "arguments": {"a": "б"}}'
    out = get_tool_parser("gigachat3").extract(text)
    assert out.content == "ok" and _calls(out) == [("f", {"a": "б"})]
    out = get_tool_parser("gigachat3").extract('function call{"name": "f", "arguments": {}}')
    assert out.content is None and _calls(out) == [("f", {})]


def test_gigachat_prose_mentioning_a_function_call_stays_streamed_content():
    parser = get_tool_parser("gigachat3")
    text = "A function call is how code runs a function; the function call returns."
    assert parser.extract(text).content == text
    state = parser.stream()
    early = []
    for ch in text[:-10]:
        early += state.feed(ch)
    # not held back to the end: everything but a possible partial marker has streamed already
    assert "".join(d.text for d in early if isinstance(d, ContentDelta)).startswith("A function call is how code")


def test_hermes_arguments_as_encoded_string():
    out = get_tool_parser("hermes").extract('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert _calls(out) == [("f", {"a": 1})]


def _cases():
    for family in WRITERS:
        yield family, WRITERS[family]([NESTED])
        yield family, CONTENT + "\n" + WRITERS[family]([WEATHER])
    for family in PARALLEL:
        yield family, "Sure.\n" + WRITERS[family]([WEATHER, NESTED, SEARCH])


CASES = list(_cases())


@pytest.mark.parametrize(("family", "text"), CASES)
def test_streaming_one_char_deltas_reassemble_extract(family, text):
    parser = get_tool_parser(family)
    want = parser.extract(text)
    assert want.calls
    deltas = _stream(parser, list(text))
    _same(assemble(deltas), want)
    # OpenAI's shape: id and name on each call's first delta only, argument fragments after
    seen = set()
    for d in deltas:
        if isinstance(d, ToolCallDelta):
            assert (d.id is not None) == (d.index not in seen) == (d.name is not None)
            seen.add(d.index)
        else:
            assert isinstance(d, ContentDelta) and d.text
    if family == "kimi_k2":
        assert [d.id for d in deltas if isinstance(d, ToolCallDelta) and d.id] == [c.id for c in want.calls]
    # arguments really stream: the longest call's arguments come in several fragments
    assert sum(1 for d in deltas if isinstance(d, ToolCallDelta) and d.arguments) > len(want.calls)


@settings(max_examples=60, deadline=None)
@given(case=st.sampled_from(CASES), data=st.data())
def test_streaming_random_split_points(case, data):
    family, text = case
    cuts = sorted(data.draw(st.sets(st.integers(1, len(text) - 1), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    parser = get_tool_parser(family)
    _same(assemble(_stream(parser, pieces)), parser.extract(text))


_ATOMS = {
    "hermes": ["<tool_call>", "</tool_call>", "\n"],
    "llama3_json": ["<|python_tag|>", ";", " "],
    "deepseek_v3": [
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁call▁begin｜>",
        "function<｜tool▁sep｜>",
        "<｜tool▁call▁end｜>",
        "```json\n",
        "\n```",
    ],
    "deepseek_v31": ["<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"],
    "kimi_k2": [
        "<|tool_calls_section_begin|>",
        "<|tool_call_begin|>",
        "functions.f:0",
        "<|tool_call_argument_begin|>",
        "<|tool_call_end|>",
    ],
    "glm45": ["<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>", "\n"],
    "gigachat3": ["function call", "<|role_sep|>", "<|function_call|>", "\n"],
}
_JSON_BITS = [
    '{"name": "f", "arguments": {"a": [1, "x}"]}}',
    '{"name": "g", "parameters": {}}',
    '{"a": 1}',
    "f",
    "{",
    "}",
    '"',
    "\\",
    "é",
    " ",
]


@settings(max_examples=200, deadline=None)
@given(data=st.data(), family=st.sampled_from(list(WRITERS)))
def test_random_marker_soup_never_raises_and_valid_calls_stream_the_same(data, family):
    whole = [WRITERS[family]([WEATHER]), "Hi. "]
    parts = data.draw(st.lists(st.sampled_from(_ATOMS[family] + _JSON_BITS + whole), max_size=14))
    text = "".join(parts)
    parser = get_tool_parser(family)
    out = parser.extract(text)
    if not out.calls:
        assert (
            out.content == text
            or (out.content is None and not text.strip())
            or family in ("deepseek_v3", "deepseek_v31", "kimi_k2")
        )
    cuts = sorted(data.draw(st.sets(st.integers(1, max(1, len(text) - 1)), max_size=8))) if len(text) > 1 else []
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
    streamed = assemble(_stream(parser, pieces))
    if out.calls:
        _same(streamed, out)
    elif not streamed.calls and family not in ("deepseek_v3", "deepseek_v31", "kimi_k2"):
        # nothing was a call: the stream gives the same content (the section-marker families may drop a stray
        # section marker there when text separates it from a broken call; see split_blocks)
        _same(streamed, out)


# Template round trip: each family's assistant tool-call turn, rendered by a tiny Jinja template written from the
# family's published chat template (only the parts that render tool calls and tool results), parsed back.
_ROUND_TRIP = {
    "hermes": (
        "{% for m in messages %}<|im_start|>{{ 'user' if m.role == 'tool' else m.role }}\n"
        "{% if m.role == 'tool' %}<tool_response>\n{{ m.content }}\n</tool_response>"
        "{% else %}{{ m.content or '' }}{% for tc in m.tool_calls or [] %}{% set f = tc.function %}"
        '\n<tool_call>\n{"name": "{{ f.name }}", "arguments": '
        "{{ f.arguments if f.arguments is string else f.arguments | tojson }}}\n</tool_call>{% endfor %}"
        "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "<|im_end|>",
    ),
    "llama3_json": (
        "{% for m in messages %}<|start_header_id|>{{ 'ipython' if m.role == 'tool' else m.role }}<|end_header_id|>\n\n"
        "{% if m.tool_calls %}{% set f = m.tool_calls[0].function %}"  # Llama 3.1: one call, no content
        '{"name": "{{ f.name }}", "parameters": {{ f.arguments | tojson }}}'
        "{% else %}{{ m.content }}{% endif %}<|eot_id|>{% endfor %}"
        "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}",
        "<|eot_id|>",
    ),
    "deepseek_v3": (
        "{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
        "{% elif m.role == 'tool' %}<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>{{ m.content }}"
        "<｜tool▁output▁end｜><｜tool▁outputs▁end｜>{% else %}<｜Assistant｜>{{ m.content or '' }}"
        "<｜tool▁calls▁begin｜>{% for tc in m.tool_calls %}{% if not loop.first %}\n{% endif %}"
        "{{ '<｜tool▁call▁begin｜>' + tc.type + '<｜tool▁sep｜>' + tc.function.name + '\\n```json\\n' "
        "+ tc.function.arguments + '\\n```<｜tool▁call▁end｜>' }}{% endfor %}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>"
        "{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}",
        "<｜end▁of▁sentence｜>",
    ),
    "deepseek_v31": (
        "{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
        "{% elif m.role == 'tool' %}<｜tool▁output▁begin｜>{{ m.content }}<｜tool▁output▁end｜>"
        "{% else %}<｜Assistant｜></think>{{ m.content or '' }}<｜tool▁calls▁begin｜>{% for tc in m.tool_calls %}"
        "{{ '<｜tool▁call▁begin｜>' + tc.function.name + '<｜tool▁sep｜>' + tc.function.arguments "
        "+ '<｜tool▁call▁end｜>' }}"
        "{% endfor %}<｜tool▁calls▁end｜><｜end▁of▁sentence｜>{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}<｜Assistant｜></think>{% endif %}",
        "<｜end▁of▁sentence｜>",
    ),
    "kimi_k2": (
        "{% for m in messages %}<|im_{{ 'system' if m.role == 'tool' else m.role }}|>{{ m.role }}<|im_middle|>"
        "{% if m.role == 'tool' %}## Return of {{ m.tool_call_id }}\n{{ m.content }}"
        "{% else %}{{ m.content or '' }}{% if m.tool_calls %}<|tool_calls_section_begin|>{% for tc in m.tool_calls %}"
        "<|tool_call_begin|>{{ tc.id }}<|tool_call_argument_begin|>"
        "{{ tc.function.arguments if tc.function.arguments is string else tc.function.arguments | tojson }}"
        "<|tool_call_end|>{% endfor %}<|tool_calls_section_end|>{% endif %}{% endif %}<|im_end|>{% endfor %}"
        "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}",
        "<|im_end|>",
    ),
    "glm45": (
        "{% for m in messages %}{% if m.role == 'user' %}<|user|>\n{{ m.content }}"
        "{% elif m.role == 'tool' %}<|observation|>\n<tool_response>\n{{ m.content }}\n</tool_response>"
        "{% else %}<|assistant|>\n{{ m.content or '' }}{% for tc in m.tool_calls %}{% set f = tc.function %}"
        "\n<tool_call>{{ f.name }}\n{% for k, v in f.arguments.items() %}<arg_key>{{ k }}</arg_key>\n"
        "<arg_value>{{ v if v is string else v | tojson }}</arg_value>\n{% endfor %}</tool_call>{% endfor %}"
        "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}",
        "<|observation|>",
    ),
    "gigachat3": (
        "{% for m in messages %}{% if m.role == 'tool' %}function result<|role_sep|>\n{{ m.content }}"
        "{% elif m.tool_calls %}assistant<|role_sep|>\n{{ m.content or '' }}function call<|role_sep|>\n"
        "{% set f = m.tool_calls[0].function %}"
        '{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}'
        "{% else %}{{ m.role }}<|role_sep|>\n{{ m.content }}{% endif %}<|message_sep|>\n\n{% endfor %}"
        "{% if add_generation_prompt %}assistant<|role_sep|>\n{% endif %}",
        "<|message_sep|>",
    ),
}
# these templates concatenate the arguments as a string (as DeepSeek's published ones do), so they must be JSON text
_STRING_ARGS = {"deepseek_v3", "deepseek_v31"}


def _render(template: str, messages: list[dict], add_generation_prompt: bool) -> str:
    env = jinja2.Environment()
    env.filters["tojson"] = lambda v: json.dumps(v, ensure_ascii=False)  # as transformers' chat templates do
    return env.from_string(template).render(messages=messages, add_generation_prompt=add_generation_prompt)


@pytest.mark.parametrize("family", list(_ROUND_TRIP))
def test_template_round_trip(family):
    template, end_of_turn = _ROUND_TRIP[family]
    single = family in ("gigachat3", "llama3_json")  # their templates render one call per message
    calls = [NESTED] if single else [WEATHER, NESTED]
    tool_calls = [
        {
            "id": f"functions.{n}:{i}" if family == "kimi_k2" else f"call_{i}",
            "type": "function",
            "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False) if family in _STRING_ARGS else a},
        }
        for i, (n, a) in enumerate(calls)
    ]
    user = {"role": "user", "content": "Plan a trip to Zürich."}
    prompt = _render(template, [user], add_generation_prompt=True)
    turn = {"role": "assistant", "content": CONTENT, "tool_calls": tool_calls}
    result = {"role": "tool", "tool_call_id": tool_calls[0]["id"], "content": '{"temp": 21}'}
    full = _render(template, [user, turn, result], add_generation_prompt=True)
    assert full.startswith(prompt) and '{"temp": 21}' in full
    generated = full[len(prompt) :].split(end_of_turn)[0]  # what the model would have generated
    out = get_tool_parser(family).extract(generated)
    assert out.content == (None if family == "llama3_json" else CONTENT)
    assert _calls(out) == calls
    if family == "kimi_k2":
        assert [c.id for c in out.calls] == [tc["id"] for tc in tool_calls]
    _same(assemble(_stream(get_tool_parser(family), list(generated))), out)


@pytest.fixture(scope="module")
def tokenizer():
    from tokenfab.engine.core.client import load_tokenizer

    return load_tokenizer(None)


@pytest.mark.parametrize("family", list(_ROUND_TRIP))
def test_template_round_trip_through_the_server_renderer(family, tokenizer):
    """The same round trip through the server's own path: OpenAI messages (arguments as JSON text, as clients
    send them) -> `render_chat` (transformers' apply_chat_template, the family template as the model's). The
    DeepSeek templates concatenate the arguments as a string, the others iterate or ``tojson`` them: both work."""
    from tokenfab.server.chat_template import render_chat
    from tokenfab.server.protocol import ChatMessage

    template, end_of_turn = _ROUND_TRIP[family]
    single = family in ("gigachat3", "llama3_json")
    calls = [NESTED] if single else [WEATHER, NESTED]
    tool_calls = [{"id": f"functions.{n}:{i}" if family == "kimi_k2" else f"call_{i}", "type": "function",
                   "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)}}
                  for i, (n, a) in enumerate(calls)]
    user = {"role": "user", "content": "Plan a trip to Zürich."}
    turn = {"role": "assistant", "content": CONTENT, "tool_calls": tool_calls}
    result = {"role": "tool", "tool_call_id": tool_calls[0]["id"], "content": '{"temp": 21}'}

    def render(msgs: list[dict]) -> str:
        return render_chat(tokenizer, [ChatMessage.model_validate(m) for m in msgs], chat_template=template)

    prompt, full = render([user]), render([user, turn, result])
    assert full.startswith(prompt) and '{"temp": 21}' in full
    out = get_tool_parser(family).extract(full[len(prompt) :].split(end_of_turn)[0])
    assert out.content == (None if family == "llama3_json" else CONTENT)
    assert _calls(out) == calls
