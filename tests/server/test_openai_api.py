"""The OpenAI API against a live server on the bundled model, driven by the official client."""

from __future__ import annotations

import asyncio
import json

import pytest

from tests.server.conftest import GREEDY_CHAT, GREEDY_MAX_TOKENS, GREEDY_PROMPTS, metric


def test_models_health_tokenize(served, client, http):
    models = client.models.list()
    assert [m.id for m in models.data] == [served.model]
    assert client.models.retrieve(served.model).id == served.model
    assert http.get("/v1/models/no-such-model").status_code == 404
    assert http.get("/health").status_code == 200
    r = http.post("/tokenize", json={"prompt": "Hello world"})
    assert r.status_code == 200
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 0
    r2 = http.post("/detokenize", json={"tokens": body["tokens"]})
    assert r2.json()["prompt"] == "Hello world"
    chat = http.post("/tokenize", json={"messages": GREEDY_CHAT}).json()
    assert chat["tokens"] == served.llm.apply_chat_template(GREEDY_CHAT)


def test_greedy_completion_equals_llm_generate(served, client):
    for prompt, expected in zip(GREEDY_PROMPTS, served.expected_completions):
        r = client.completions.create(model=served.model, prompt=prompt, max_tokens=GREEDY_MAX_TOKENS,
                                      temperature=0)
        choice = r.choices[0]
        assert choice.text == expected.outputs[0].text
        assert choice.finish_reason == expected.outputs[0].finish_reason
        assert r.usage.prompt_tokens == len(expected.prompt_token_ids)
        assert r.usage.completion_tokens == len(expected.outputs[0].token_ids)
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
        assert r.object == "text_completion" and r.model == served.model


def test_greedy_chat_equals_llm_chat_and_streams_the_same(served, client):
    expected = served.expected_chat.outputs[0]
    r = client.chat.completions.create(model=served.model, messages=GREEDY_CHAT,
                                       max_tokens=GREEDY_MAX_TOKENS, temperature=0)
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == expected.text
    assert r.choices[0].finish_reason == expected.finish_reason
    assert r.usage.prompt_tokens == len(served.expected_chat.prompt_token_ids)
    assert r.usage.completion_tokens == len(expected.token_ids)

    stream = client.chat.completions.create(model=served.model, messages=GREEDY_CHAT,
                                            max_tokens=GREEDY_MAX_TOKENS, temperature=0, stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [expected.finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert all(c.usage is None for c in chunks[:-1])


def test_streaming_completion_matches_non_streaming(served, client):
    prompt, expected = GREEDY_PROMPTS[0], served.expected_completions[0].outputs[0]
    stream = client.completions.create(model=served.model, prompt=prompt, max_tokens=GREEDY_MAX_TOKENS,
                                       temperature=0, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == expected.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == expected.finish_reason
    usage = chunks[-1].usage
    assert usage.completion_tokens == len(expected.token_ids) and usage.prompt_tokens > 0


def test_n2_completion_and_chat(served, client):
    r = client.completions.create(model=served.model, prompt="Once upon a time", max_tokens=4, n=2,
                                  temperature=1.0, seed=7, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.finish_reason == "length" for c in r.choices)
    assert r.usage.completion_tokens == 8
    stream = client.chat.completions.create(model=served.model, messages=GREEDY_CHAT, max_tokens=3, n=2,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True})
    texts = {0: "", 1: ""}
    finished = set()
    usage = None
    for c in stream:
        if c.usage:
            usage = c.usage
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finished.add(ch.index)
    assert finished == {0, 1}
    assert usage.completion_tokens == 6
    assert all(texts.values())


def test_stop_strings(served, client):
    # The greedy continuation is known: stop at a piece of it and the text ends just before.
    full = served.expected_completions[0].outputs[0].text  # e.g. " Paris.\n\nThe answer is:"
    assert len(full.strip()) > 3
    stop = full.strip()[2:4]
    cut = full.index(stop)
    r = client.completions.create(model=served.model, prompt=GREEDY_PROMPTS[0], max_tokens=GREEDY_MAX_TOKENS,
                                  temperature=0, stop=[stop, "@@never@@"])
    assert r.choices[0].text == full[:cut]
    assert r.choices[0].finish_reason == "stop"
    # streamed: the stop string must not leak into the deltas either
    chunks = list(client.completions.create(model=served.model, prompt=GREEDY_PROMPTS[0], max_tokens=8,
                                            temperature=0, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == full[:cut]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completion_logprobs_and_echo(served, client):
    r = client.completions.create(model=served.model, prompt=GREEDY_PROMPTS[0], max_tokens=4, temperature=0,
                                  logprobs=3)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    for val, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert val <= 0.0
        assert 1 <= len(top) <= 3
        # greedy: the chosen token is the most likely one
        assert max(top.values()) == pytest.approx(val, abs=1e-4)
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset)

    e = client.completions.create(model=served.model, prompt=GREEDY_PROMPTS[0], max_tokens=4, temperature=0,
                                  echo=True)
    assert e.choices[0].text == GREEDY_PROMPTS[0] + r.choices[0].text


def test_chat_logprobs(served, client):
    r = client.chat.completions.create(model=served.model, messages=GREEDY_CHAT, max_tokens=4, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for item in content:
        assert item.logprob <= 0.0
        assert len(item.top_logprobs) == 2
        assert item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-4)
        assert bytes(item.bytes).decode("utf-8", errors="replace") == item.token
    # streamed logprobs arrive with their tokens
    chunks = list(client.chat.completions.create(model=served.model, messages=GREEDY_CHAT, max_tokens=4,
                                                 temperature=0, logprobs=True, stream=True))
    streamed = [x for c in chunks if c.choices and c.choices[0].logprobs for x in c.choices[0].logprobs.content]
    assert [x.token for x in streamed] == [x.token for x in content]


def test_seeded_sampling_is_reproducible(served, client):
    def sample(seed: int) -> str:
        r = client.completions.create(model=served.model, prompt="My favourite animal is", max_tokens=6,
                                      temperature=1.0, top_p=0.95, seed=seed, extra_body={"ignore_eos": True})
        return r.choices[0].text

    a, b = sample(1234), sample(1234)
    assert a == b
    others = {sample(s) for s in (1, 2, 3)}
    assert len(others | {a}) > 1  # different seeds give different samples


def test_sampling_extras_accepted(served, client):
    r = client.completions.create(
        model=served.model, prompt="List three fruits:", max_tokens=4, temperature=0.8, presence_penalty=0.5,
        frequency_penalty=0.5, user="tester",
        extra_body={"top_k": 20, "min_p": 0.05, "repetition_penalty": 1.1, "min_tokens": 2, "ignore_eos": True},
    )
    assert r.usage.completion_tokens == 4 and r.choices[0].finish_reason == "length"


def test_max_completion_tokens_and_length(served, client):
    r = client.chat.completions.create(model=served.model, messages=GREEDY_CHAT, max_completion_tokens=2,
                                       extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2 and r.choices[0].finish_reason == "length"


SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 100},
    },
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}


def _validate(value, schema) -> None:
    """jsonschema.validate when installed; else a check of the keywords SCHEMA uses."""
    try:
        import jsonschema
    except ImportError:
        jsonschema = None
    if jsonschema is not None:
        jsonschema.validate(value, schema)
        return
    types = {"object": dict, "string": str, "integer": int}
    assert isinstance(value, types[schema["type"]]) and not isinstance(value, bool)
    if "enum" in schema:
        assert value in schema["enum"]
    if "minimum" in schema:
        assert value >= schema["minimum"]
    if "maximum" in schema:
        assert value <= schema["maximum"]
    if schema["type"] == "object":
        assert set(schema.get("required", [])) <= set(value)
        if schema.get("additionalProperties") is False:
            assert set(value) <= set(schema["properties"])
        for k, v in value.items():
            _validate(v, schema["properties"][k])


def test_json_schema_output_validates(served, client):
    for temperature in (0.0, 1.0):
        r = client.chat.completions.create(
            model=served.model, messages=[{"role": "user", "content": "Is the sky blue? Reply in JSON."}],
            max_tokens=40, temperature=temperature, seed=3,
            response_format={"type": "json_schema", "json_schema": {"name": "verdict", "schema": SCHEMA,
                                                                    "strict": True}},
        )
        assert r.choices[0].finish_reason == "stop"
        _validate(json.loads(r.choices[0].message.content), SCHEMA)


def test_json_object_output_parses(served, client):
    r = client.completions.create(
        model=served.model, prompt="A JSON object with a name and an age:", max_tokens=40, temperature=0,
        extra_body={"response_format": {"type": "json_object"}},
    )
    text = r.choices[0].text
    if r.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(text), dict)
    else:  # ran out of tokens mid-object: still a valid JSON prefix of an object
        assert text.lstrip().startswith("{")


def test_32_concurrent_streams_finish_with_correct_usage(served, aclient_factory, http):
    prompts = [f"Request number {i}: write a word about the number {i}." for i in range(32)]
    max_tokens = 4

    async def one(client, prompt):
        stream = await client.completions.create(model=served.model, prompt=prompt, max_tokens=max_tokens,
                                                 temperature=0.5, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        text, usage, finish = "", None, None
        async for c in stream:
            if c.usage:
                usage = c.usage
            for ch in c.choices:
                text += ch.text
                finish = ch.finish_reason or finish
        return text, usage, finish

    async def main():
        client = aclient_factory()
        async with client:
            return await asyncio.gather(*(one(client, p) for p in prompts))

    results = asyncio.run(main())
    assert len(results) == 32
    for prompt, (text, usage, finish) in zip(prompts, results):
        assert text
        assert finish == "length"
        assert usage.completion_tokens == max_tokens
        assert usage.prompt_tokens == http.post("/tokenize", json={"prompt": prompt}).json()["count"]
        assert usage.total_tokens == usage.prompt_tokens + max_tokens
    m = http.get("/metrics").text
    assert metric(m, "tokenfab_time_to_first_token_seconds_count") >= 32
    assert metric(m, "tokenfab_time_per_output_token_seconds_count") >= 32
    assert metric(m, "tokenfab_generation_tokens_total") >= 32 * max_tokens


def test_metrics_exposes_engine_state(served, http):
    text = http.get("/metrics").text
    for name in ("tokenfab_num_requests_running", "tokenfab_num_requests_waiting", "tokenfab_kv_cache_usage_perc",
                 "tokenfab_prompt_tokens_total", "tokenfab_generation_tokens_total",
                 "tokenfab_num_preemptions_total", "tokenfab_kv_cache_capacity_tokens",
                 "tokenfab_prefix_cache_hit_rate", "tokenfab_last_step_num_seqs",
                 "tokenfab_last_step_prefill_tokens", "tokenfab_last_step_decode_tokens"):
        assert metric(text, name) >= 0
    assert metric(text, "tokenfab_engine_steps_total") > 0
    assert "tokenfab_time_to_first_token_seconds_bucket" in text
    assert "tokenfab_time_per_output_token_seconds_bucket" in text
