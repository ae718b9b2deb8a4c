"""Reasoning parsers (tokenfab/server/reasoning): fixed model-format texts, streaming reassembly, and a
template round trip per family (tiny Jinja templates written from each family's published chat template:
the generation prompt and the layout of an assistant turn with reasoning)."""

from __future__ import annotations

import random

import jinja2
import pytest

from tests.server.harmony_skip import skip_without_harmony_vocab
from tokenfab.server.reasoning import (
    REASONING_PARSERS,
    get_reasoning_parser,
    join_pieces,
    reasoning_parser_for_model,
)
from tokenfab.server.reasoning.harmony_vocab import HarmonyVocabUnavailable

THINK_PARSERS = ["deepseek_r1", "deepseek_v3", "qwen3", "glm45", "kimi_k2"]
ON = {"deepseek_r1": {}, "deepseek_v3": {"thinking": True}, "qwen3": {"enable_thinking": True},
      "glm45": {"enable_thinking": True}, "kimi_k2": {"thinking": True}}
OFF = {"deepseek_v3": {"thinking": False}, "qwen3": {"enable_thinking": False},
       "glm45": {"enable_thinking": False}, "kimi_k2": {"thinking": False}}


def stream_chunks(parser, text: str, sizes: list[int]) -> tuple[str | None, str | None]:
    """Feed `text` cut into pieces of the given sizes (cycled); return the joined (reasoning, content)."""
    s, pieces, i, k = parser.stream(), [], 0, 0
    while i < len(text):
        n = sizes[k % len(sizes)]
        pieces += s.feed(text[i : i + n])
        i, k = i + n, k + 1
    pieces += s.finish()
    for kind, part in pieces:
        assert kind in ("reasoning", "content") and part
    return join_pieces(pieces)


def check(parser, text: str, expected: tuple[str | None, str | None]) -> None:
    assert parser.extract(text) == expected
    assert stream_chunks(parser, text, [1]) == expected  # 1-character deltas
    rng = random.Random(len(text))
    for _ in range(5):
        assert stream_chunks(parser, text, [rng.randint(1, 9) for _ in range(7)]) == expected


# ---------------------------------------------------------------- think-tag families on fixed texts


@pytest.mark.parametrize("name", THINK_PARSERS)
def test_reasoning_then_content(name):
    p = get_reasoning_parser(name, chat_template_kwargs=ON[name])
    check(p, "<think>\nThe user greets me; 2+2=4 ≠ 5.\n</think>\n\nHello, 世界!", (
        "The user greets me; 2+2=4 ≠ 5.", "Hello, 世界!"))
    # The opening tag already in the prompt (DeepSeek-R1/V3.1 and Kimi K2.5 templates): output starts inside.
    p = get_reasoning_parser(name, chat_template_kwargs=ON[name], prompt="<|user|>hi<|assistant|><think>\n")
    check(p, "Short thought.</think>Answer.", ("Short thought.", "Answer."))


@pytest.mark.parametrize("name", THINK_PARSERS)
def test_no_reasoning(name):
    """A block closed by the template (prompt ends with </think>) or never opened: all content, verbatim."""
    p = get_reasoning_parser(name, chat_template_kwargs=ON[name], prompt="<|assistant|><think></think>")
    check(p, "  Just an answer <b>bold</b>.", (None, "  Just an answer <b>bold</b>."))
    check(get_reasoning_parser(name, prompt="<|assistant|>"), "Plain < answer >", (None, "Plain < answer >"))
    check(get_reasoning_parser(name, prompt="<|assistant|>"), "", (None, None))


@pytest.mark.parametrize("name", THINK_PARSERS)
def test_unterminated_reasoning_is_reasoning(name):
    """Cut off (max_tokens) inside the block: everything is reasoning, in every family (stated convention)."""
    p = get_reasoning_parser(name, chat_template_kwargs=ON[name])
    check(p, "<think>I was still thinking about </thi", ("I was still thinking about </thi", None))
    p = get_reasoning_parser(name, chat_template_kwargs=ON[name], prompt="<think>")
    check(p, "still thinking <", ("still thinking <", None))


@pytest.mark.parametrize("name", sorted(OFF))
def test_thinking_switched_off(name):
    """Thinking off via chat_template_kwargs: the output is content even if it spells think tags."""
    p = get_reasoning_parser(name, chat_template_kwargs=OFF[name])
    text = "<think>not parsed</think> answer"
    check(p, text, (None, text))
    on = get_reasoning_parser(name, chat_template_kwargs=ON[name])
    assert on.extract(text) == ("not parsed", "answer")


def test_deepseek_v3_thinks_only_when_asked():
    """DeepSeek-V3.1's `thinking` defaults to off, so plain V3/GigaChat3 output is never taken for reasoning."""
    assert get_reasoning_parser("deepseek_v3").extract("a</think>b") == (None, "a</think>b")
    assert get_reasoning_parser("deepseek_v3", chat_template_kwargs={"thinking": True}).extract("a</think>b") == (
        "a", "b")


def test_tool_call_after_reasoning_is_in_content_only():
    """A call the model only considered while thinking stays in reasoning; the real one is in content."""
    p = get_reasoning_parser("qwen3")
    text = ('<think>Maybe <tool_call>{"name": "wrong", "arguments": {}}</tool_call>? No.</think>\n\n'
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>')
    reasoning, content = p.extract(text)
    assert reasoning == 'Maybe <tool_call>{"name": "wrong", "arguments": {}}</tool_call>? No.'
    assert content == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>'
    check(p, text, (reasoning, content))
    # Then the family's tool parser (tokenfab/server/tools) sees the content only: one call, the real one.
    from tokenfab.server.tools import assemble, get_tool_parser

    hermes = get_tool_parser("hermes")
    calls = [(c.name, c.arguments_json) for c in hermes.extract(content).calls]
    assert calls == [("get_weather", '{"city": "Zürich"}')]
    rs, ts, deltas = p.stream(), hermes.stream(), []
    for ch in text:
        deltas += [d for kind, part in rs.feed(ch) if kind == "content" for d in ts.feed(part)]
    deltas += [d for kind, part in rs.finish() if kind == "content" for d in ts.feed(part)] + ts.finish()
    assert [(c.name, c.arguments_json) for c in assemble(deltas).calls] == calls


def test_kimi_tool_section_ends_reasoning():
    """Kimi K2 may go from thinking straight into its tool-call section; the section is content."""
    p = get_reasoning_parser("kimi_k2", prompt="<|im_assistant|>assistant<|im_middle|><think>")
    call = ('<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
            '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')
    check(p, "I need the weather." + call, ("I need the weather.", call))


def test_registry():
    assert set(REASONING_PARSERS) == {*THINK_PARSERS, "gpt_oss"}
    assert reasoning_parser_for_model("qwen3_moe") == "qwen3"
    assert reasoning_parser_for_model("glm4_moe") == "glm45"
    assert reasoning_parser_for_model("kimi_k2") == "kimi_k2"
    assert reasoning_parser_for_model("deepseek_v3") == "deepseek_v3"
    assert reasoning_parser_for_model("gpt_oss") == "gpt_oss"
    assert reasoning_parser_for_model("llama") is None
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_reasoning_parser("nope")


# ---------------------------------------------------------------- template round trip

# Each: the generation prompt and an assistant turn with `reasoning_content`, as the family's published template
# writes them (the turn layout is what the model is trained to generate after the prompt).
TEMPLATES = {
    "qwen3": (  # Qwen3: model writes <think>; enable_thinking=false prefills an empty block
        "{% for m in messages %}<|im_start|>{{ m.role }}\n"
        "{% if m.role == 'assistant' and m.reasoning_content %}<think>\n{{ m.reasoning_content.strip('\n') }}\n"
        "</think>\n\n{% endif %}{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
        "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}",
        "<|im_end|>\n"),
    "deepseek_r1": (  # R1-0528: the generation prompt opens the block
        "<｜begin▁of▁sentence｜>{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
        "{% else %}<｜Assistant｜><think>\n{{ m.reasoning_content }}\n</think>\n\n{{ m.content }}"
        "<｜end▁of▁sentence｜>{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜><think>\n"
        "{% endif %}",
        "<｜end▁of▁sentence｜>"),
    "deepseek_v3": (  # V3.1: <think> when thinking, </think> otherwise
        "<｜begin▁of▁sentence｜>{% for m in messages %}{% if m.role == 'user' %}<｜User｜>{{ m.content }}"
        "{% else %}<｜Assistant｜>{% if thinking %}<think>{{ m.reasoning_content }}{% endif %}</think>"
        "{{ m.content }}<｜end▁of▁sentence｜>{% endif %}{% endfor %}{% if add_generation_prompt %}<｜Assistant｜>"
        "{% if thinking %}<think>{% else %}</think>{% endif %}{% endif %}",
        "<｜end▁of▁sentence｜>"),
    "glm45": (  # GLM-4.5: model writes <think>; enable_thinking=false prefills <think></think>
        "[gMASK]<sop>{% for m in messages %}{% if m.role == 'user' %}<|user|>\n{{ m.content }}{% else %}"
        "<|assistant|>\n<think>{{ m.reasoning_content.strip() }}</think>\n{{ m.content.strip() }}{% endif %}"
        "{% endfor %}{% if add_generation_prompt %}<|assistant|>{{ '\n<think></think>' if (enable_thinking "
        "is defined and not enable_thinking) else '' }}{% endif %}",
        ""),
    "kimi_k2": (  # Kimi K2.5: the prompt opens <think> when thinking, writes <think></think> when not
        "{% for m in messages %}{% if m.role == 'user' %}<|im_user|>user<|im_middle|>{{ m.content }}<|im_end|>"
        "{% else %}<|im_assistant|>assistant<|im_middle|><think>{{ m.reasoning_content }}</think>{{ m.content }}"
        "<|im_end|>{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>"
        "{% if thinking is defined and thinking is false %}<think></think>{% else %}<think>{% endif %}{% endif %}",
        "<|im_end|>"),
}


# DeepSeek-R1's template has no switch to turn thinking off, so it is round-tripped with thinking only.
@pytest.mark.parametrize(("name", "thinking"), [(n, True) for n in THINK_PARSERS] + [(n, False) for n in OFF])
def test_template_round_trip(name, thinking):
    kwargs = ON[name] if thinking else OFF[name]
    template, end_of_turn = TEMPLATES[name]
    tmpl = jinja2.Environment().from_string(template)
    user = [{"role": "user", "content": "What is 6 times 7?"}]
    reply = {"role": "assistant", "content": "It is 42.",
             "reasoning_content": "6 * 7 = 42, line one.\nLine two." if thinking else ""}
    prompt = tmpl.render(messages=user, add_generation_prompt=True, **kwargs)
    full = tmpl.render(messages=[*user, reply], add_generation_prompt=False, **kwargs)
    if not thinking:  # what the model writes after a prompt that closed the block: the answer only
        full = prompt + reply["content"] + end_of_turn
    assert full.startswith(prompt) and full.endswith(end_of_turn)
    completion = full[len(prompt) : len(full) - len(end_of_turn)]
    parser = get_reasoning_parser(name, chat_template_kwargs=kwargs, prompt=prompt)
    expected = (reply["reasoning_content"] or None, reply["content"])
    check(parser, completion, expected)
    # Without the prompt the family's default template behaviour gives the same split.
    assert get_reasoning_parser(name, chat_template_kwargs=kwargs).extract(completion) == expected


# ---------------------------------------------------------------- GPT-OSS (Harmony)

harmony = skip_without_harmony_vocab()


@harmony
def test_gpt_oss_channels():
    p = get_reasoning_parser("gpt_oss")
    text = ("<|channel|>analysis<|message|>User asks 6*7. 答え=42.<|end|><|start|>assistant<|channel|>final"
            "<|message|>It is 42 ✓.<|return|>")
    check(p, text, ("User asks 6*7. 答え=42.", "It is 42 ✓."))
    # A preamble on commentary is content; a function call is neither (the GPT-OSS tool parser takes it).
    text = ("<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary<|message|>"
            "Checking.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
            '<|message|>{"city": "Paris"}<|call|>')
    check(p, text, ("Need weather.", "Checking."))
    check(p, "<|channel|>analysis<|message|>cut off mid-tho", ("cut off mid-tho", None))
    check(p, "no harmony at all <|end|> here", (None, "no harmony at all <|end|> here"))
    check(p, "<|channel|>final<|message|>ok<|end|>junk after", (None, "okjunk after"))


@harmony
def test_gpt_oss_round_trip_through_harmony():
    """Render an assistant reply with openai-harmony's own renderer, then parse the token ids back."""
    from openai_harmony import Conversation, Message, Role

    from tokenfab.server.reasoning.gpt_oss import GptOssReasoningParser
    from tokenfab.server.reasoning.harmony_vocab import harmony_encoding

    enc = harmony_encoding()
    conv = Conversation.from_messages([Message.from_role_and_content(Role.USER, "What is 6 times 7?")])
    prompt = enc.render_conversation_for_completion(conv, Role.ASSISTANT)
    reply = [Message.from_role_and_content(Role.ASSISTANT, "6*7=42.").with_channel("analysis"),
             Message.from_role_and_content(Role.ASSISTANT, "It is 42.").with_channel("final")]
    # render_conversation_for_training drops analysis before a final answer, so render message by message.
    reply_ids = [tok for m in reply for tok in enc.render(m)]
    head = enc.encode("<|start|>assistant", allowed_special="all")  # the prompt's tail, opening the reply
    assert prompt[-len(head) :] == head and reply_ids[: len(head)] == head
    completion = reply_ids[len(head) :]
    p = GptOssReasoningParser()
    assert p.extract_ids(completion) == ("6*7=42.", "It is 42.")
    s, pieces = p.stream(), []
    for tok in completion:
        pieces += s.feed_ids([tok])
    assert join_pieces(pieces + s.finish()) == ("6*7=42.", "It is 42.")


@harmony
def test_gpt_oss_state_tracking_matches_harmony():
    """HarmonyStream follows header/content/between from special tokens (Harmony's own `state` is quadratic);
    it must agree with `StreamableParser.state` token by token, malformed sequences included."""
    from openai_harmony import StreamState

    from tokenfab.server.reasoning.gpt_oss import HarmonyStream, encode_harmony_text

    names = {StreamState.HEADER: "header", StreamState.CONTENT: "content", StreamState.EXPECT_START: "between"}
    texts = ["<|channel|>analysis<|message|>a <|start|> b<|end|><|start|>assistant<|channel|>final<|message|>"
             "c<|message|>d<|return|>",
             "garbage <|end|> <|message|>x<|call|><|start|>assistant to=functions.f<|channel|>commentary"
             "<|message|>{}<|call|>"]
    for text in texts:
        h = HarmonyStream()
        for tok in encode_harmony_text(text):
            h.feed_ids([tok])
            if h._failed_ids is not None:
                break
            assert h._state == names[h._parser.state]


@harmony
def test_harmony_vocab_offline(tmp_path, monkeypatch):
    """The o200k file is rebuilt, verified against the published SHA-256, cached; a corrupt cache is rebuilt;
    a user directory without the file is a clear error."""
    import hashlib

    from tokenfab.server.reasoning import harmony_vocab as hv

    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE", raising=False)
    monkeypatch.setenv("TOKENFAB_CACHE_DIR", str(tmp_path))
    path = tmp_path / "tiktoken" / hv.O200K_FILE
    assert hv.ensure_harmony_vocab() == str(path.parent)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == hv.O200K_SHA256
    first = path.read_bytes().splitlines()[:2]
    assert first[0].split() == [b"IQ==", b"0"]  # base64("!") has rank 0 in o200k
    path.write_bytes(b"corrupt")
    monkeypatch.delenv("TIKTOKEN_ENCODINGS_BASE")
    hv.ensure_harmony_vocab()
    assert hashlib.sha256(path.read_bytes()).hexdigest() == hv.O200K_SHA256
    monkeypatch.setenv("TIKTOKEN_ENCODINGS_BASE", str(tmp_path / "empty"))
    with pytest.raises(HarmonyVocabUnavailable, match="no o200k_base.tiktoken"):
        hv.ensure_harmony_vocab()


@pytest.mark.parametrize("name", THINK_PARSERS)
def test_streaming_equals_extract_on_random_texts(name):
    """Any split of any text (built from tags, partial tags, whitespace and letters) streams to `extract`'s
    result: the held-back partial markers and whitespace never leak or vanish."""
    atoms = ["<think>", "</think>", "<", "</th", "<thi", " ", "\n", "a", "ß", "<|tool_calls_section_begin|>", "<|"]
    rng = random.Random(name)
    for case in range(300):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 12)))
        prompt = rng.choice([None, "<|assistant|>", "<|assistant|><think>\n", "<think></think>"])
        kwargs = rng.choice([ON[name], OFF.get(name, {})])
        p = get_reasoning_parser(name, chat_template_kwargs=kwargs, prompt=prompt)
        expected = p.extract(text)
        for sizes in ([1], [2, 3], [rng.randint(1, 6) for _ in range(5)]):
            assert stream_chunks(p, text, sizes) == expected, (case, text, prompt, kwargs, sizes)


@harmony
def test_gpt_oss_streaming_equals_extract_on_random_texts():
    """Text deltas split anywhere (inside special tokens, words, headers) give `extract`'s result, and
    malformed sequences never raise."""
    atoms = ["<|channel|>", "analysis", "final", "commentary", "<|message|>", "<|end|>", "<|start|>assistant",
             "<|return|>", " to=functions.f", "word ", "ü", "<", "|", "{}"]
    p = get_reasoning_parser("gpt_oss")
    rng = random.Random(0)
    for case in range(150):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 10)))
        expected = p.extract(text)
        for sizes in ([1], [rng.randint(1, 7) for _ in range(5)]):
            assert stream_chunks(p, text, sizes) == expected, (case, text, sizes)
