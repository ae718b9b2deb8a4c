"""Fuzzing, bounded in time, in the default suite (in process, fake engine: no model).

1. hypothesis over the request models: for every field of each pydantic request model, a
   plausible value or any JSON value (deep nesting, huge integers, lone surrogates, unknown keys),
   sent to the app; every answer is < 500, every 4xx carries OpenAI's error body, every 200 is
   valid against its documented response model, every stream ends with [DONE] and no error event.
2. schemathesis over the app's own OpenAPI document (conformance checks, see fuzzing.py).
Both run a few examples in the fast tier and more in their slow-tier twins (``-long``).
The long live-server run on the bundled model is in test_fuzz_live.py (slow) and
scripts/fuzz_server.py.
"""

from __future__ import annotations

import collections
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.server.fake_engine import FakeEngine
from tests.server.fuzzing import _check_error_body, _check_stream, run_schemathesis
from tests.server.inprocess import fake_server
from tokenfab.engine.core.async_engine import AsyncEngine
from tokenfab.server.app import ServerConfig, build_app
from tokenfab.server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from tokenfab.server.responses import ChatCompletionResponse, CompletionResponse, DetokenizeResponse, TokenizeResponse

EXAMPLES = 30  # per endpoint; the slow tier's twins run LONG_EXAMPLES
LONG_EXAMPLES = 120
SCHEMATHESIS_EXAMPLES = 8  # per operation and mode; the slow tier's twin runs SCHEMATHESIS_LONG_EXAMPLES
SCHEMATHESIS_LONG_EXAMPLES = 25
STATUSES: collections.Counter = collections.Counter()

weird_text = st.one_of(st.text(max_size=12), st.sampled_from(["\ud800", "a\udfffb", "\x00", "😀" * 3, "", " "]))
huge_int = st.one_of(st.integers(-3, 40), st.integers(-(2**70), 2**70), st.sampled_from([2**31, 2**63, -(2**63)]))
json_value = st.recursive(
    st.none() | st.booleans() | huge_int | st.floats(allow_nan=False, allow_infinity=False) | weird_text,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(weird_text, inner, max_size=4),
    max_leaves=12,
)
token_ids = st.lists(st.integers(-2, 300), min_size=0, max_size=8)
messages = st.lists(st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant", "developer", "tool", "wizard"])},
    optional={"content": st.one_of(weird_text, st.lists(st.fixed_dictionaries(
        {"type": st.sampled_from(["text", "image_url"]), "text": weird_text}), max_size=2)), "name": weird_text}),
    min_size=0, max_size=3)

PLAUSIBLE: dict[str, st.SearchStrategy] = {
    "model": st.sampled_from(["fake-model", "gpt-4", None]),
    "prompt": st.one_of(weird_text, st.lists(weird_text, max_size=3), token_ids, st.lists(token_ids, max_size=3)),
    "messages": messages,
    "tokens": token_ids,
    "n": st.integers(0, 4), "best_of": st.integers(0, 4),
    "max_tokens": st.integers(-1, 12), "max_completion_tokens": st.integers(-1, 12), "min_tokens": st.integers(-1, 6),
    "temperature": st.floats(-1, 3), "top_p": st.floats(-0.5, 1.5), "min_p": st.floats(-0.5, 1.5),
    "top_k": huge_int, "seed": huge_int, "priority": st.integers(-2, 2),
    "stop": st.one_of(weird_text, st.lists(weird_text, max_size=3)),
    "stop_token_ids": token_ids,
    "logprobs": st.one_of(st.integers(-1, 25), st.booleans()), "top_logprobs": st.integers(-1, 25),
    "prompt_logprobs": st.integers(-1, 25),
    "logit_bias": st.dictionaries(st.one_of(st.integers(-5, 300).map(str), weird_text),
                                  st.floats(-150, 150), max_size=3),
    "response_format": st.one_of(st.fixed_dictionaries({"type": st.sampled_from(["text", "json_object", "xml"])}),
                                 json_value),
    "stream": st.booleans(), "echo": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={"include_usage": st.booleans(),
                                                          "continuous_usage_stats": st.booleans()}),
    "chat_template_kwargs": st.dictionaries(st.sampled_from(["enable_thinking", "thinking", "tokenize", "x"]),
                                            json_value, max_size=2),
    "chat_template": weird_text,
    "cache_salt": weird_text,
}


def body_strategy(model: type, required: list[str]) -> st.SearchStrategy[dict[str, Any]]:
    def value(name: str) -> st.SearchStrategy:
        plausible = PLAUSIBLE.get(name)
        return st.one_of(plausible, json_value) if plausible is not None else json_value

    fields = list(model.model_fields)
    base = st.fixed_dictionaries({n: value(n) for n in required},
                                 optional={n: value(n) for n in fields if n not in required})
    extra = st.dictionaries(st.sampled_from(["tools", "functions", "frobnicate", "stream_options"]), json_value,
                            max_size=1)
    return st.one_of(base, st.builds(lambda a, b: {**a, **b}, base, extra), json_value)


ENDPOINTS = [
    ("/v1/completions", CompletionRequest, ["prompt"], CompletionResponse),
    ("/v1/chat/completions", ChatCompletionRequest, ["messages"], ChatCompletionResponse),
    ("/tokenize", TokenizeRequest, [], TokenizeResponse),
    ("/detokenize", DetokenizeRequest, ["tokens"], DetokenizeResponse),
]


@pytest.fixture(scope="module")
def fuzz_client():
    with fake_server(ServerConfig(drain_timeout=0, max_request_bytes=1 << 20), step_time=0.0,
                     max_model_len=64) as pair:
        yield pair
    print(f"\nhypothesis fuzz statuses: {dict(sorted(STATUSES.items()))}")


@pytest.mark.parametrize("examples", [pytest.param(EXAMPLES, id="short"),
                                      pytest.param(LONG_EXAMPLES, id="long", marks=pytest.mark.slow)])
@pytest.mark.parametrize("url,model,required,response_model", ENDPOINTS, ids=[e[0] for e in ENDPOINTS])
def test_hypothesis_request_models_never_5xx(fuzz_client, url, model, required, response_model, examples):
    client, _ = fuzz_client

    @given(body=body_strategy(model, required))
    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    def fuzz(body: Any) -> None:
        resp = client.post(url, content=json.dumps(body), headers={"Content-Type": "application/json"})
        STATUSES[resp.status_code] += 1
        assert resp.status_code < 500, (body, resp.text[:500])
        assert _check_error_body(resp) is None, (body, resp.text[:500])
        assert _check_stream(resp) is None, (body, resp.text[-500:])
        if resp.status_code == 200 and "json" in resp.headers["content-type"]:
            response_model.model_validate(resp.json())

    fuzz()
    # the server lives on
    assert client.get("/health").status_code == 200


def _conformance_in_process(max_examples: int) -> None:
    import schemathesis

    engine = AsyncEngine(FakeEngine(step_time=0.0, max_model_len=64))
    app = build_app(engine, ServerConfig(drain_timeout=0))
    engine.start()
    try:
        schema = schemathesis.openapi.from_asgi("/openapi.json", app)
        report = run_schemathesis(schema, max_examples=max_examples)
    finally:
        engine.shutdown(0)
    print(f"\nschemathesis in process: {json.dumps(report.as_dict()['statuses'])} in {report.requests} requests")
    assert report.requests > 8 * max_examples
    assert report.server_errors == 0, report.failures
    assert not report.failures, "\n".join(report.failures)
    assert {200, 400} <= set(report.statuses)


def test_schemathesis_conformance_in_process():
    _conformance_in_process(SCHEMATHESIS_EXAMPLES)


@pytest.mark.slow
def test_schemathesis_conformance_in_process_long():
    _conformance_in_process(SCHEMATHESIS_LONG_EXAMPLES)
