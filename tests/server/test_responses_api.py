"""/v1/responses: the official openai client (``client.responses.create``, streamed and not, and the
``client.responses.stream`` helper) against the live server on the bundled model, plus fast tests over the fake
engine (400s, the store's bounds, reasoning items, disconnects) and unit tests of the store and the event builder.

References are independent of the endpoint: greedy text from ``LLM.chat``, prompt lengths from the Hugging Face
tokenizer's own chat template, tool arguments from jsonschema."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import jsonschema
import openai
import pytest

from tests.server.conftest import GREEDY_CHAT, GREEDY_MAX_TOKENS, LiveServer
from tests.server.fake_engine import FakeEngine
from tests.server.harmony_skip import harmony_vocab_missing
from tests.server.inprocess import assert_error, fake_server, sse_events
from tokenfab.engine.core.async_engine import AsyncEngine
from tokenfab.engine.requests.outputs import CompletionOutput, RequestOutput
from tokenfab.server.app import ServerConfig, build_app
from tokenfab.server.responses_models import ResponseObject
from tokenfab.server.responses_store import ResponseStore
from tokenfab.server.responses_stream import EventBuilder

WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
                   "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"], "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99},
                   "b": {"type": "integer", "minimum": 0, "maximum": 99}},
    "required": ["a", "b"], "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "name": "get_weather", "description": "Current weather in a city", "parameters": WEATHER},
    {"type": "function", "name": "add", "description": "Add two numbers", "parameters": ADD, "strict": True},
]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = "What is the weather in Paris?"
QUESTION = GREEDY_CHAT[0]["content"]


def _prompt_len(served: Any, messages: list[dict[str, Any]]) -> int:
    """The number of prompt tokens of ``messages`` under the model's chat template (Hugging Face's rendering)."""
    tok = served.llm.engine.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return len(tok.encode(text, add_special_tokens=False))


def _check_calls(output: list[Any]) -> list[Any]:
    calls = [item for item in output if item.type == "function_call"]
    assert calls, output
    for c in calls:
        assert c.call_id.startswith("call_") and c.id.startswith("fc_")
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])
    return calls


# ---- live server, bundled model, official client ----
def test_create_matches_llm_chat(client: openai.OpenAI, served: Any) -> None:
    r = client.responses.create(model=served.model, input=QUESTION, max_output_tokens=GREEDY_MAX_TOKENS,
                                temperature=0.0)
    assert r.object == "response" and r.id.startswith("resp_") and r.model == served.model
    assert r.output_text == served.expected_chat.outputs[0].text
    assert [item.type for item in r.output] == ["message"]
    assert r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens == _prompt_len(served, GREEDY_CHAT)
    assert r.usage.output_tokens == len(served.expected_chat.outputs[0].token_ids)
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    finished = served.expected_chat.outputs[0].finish_reason
    assert r.status == ("incomplete" if finished == "length" else "completed")
    if r.status == "incomplete":
        assert r.incomplete_details.reason == "max_output_tokens"
    ResponseObject.model_validate(r.model_dump())


def test_instructions_and_message_list_input(client: openai.OpenAI, served: Any) -> None:
    conv = [{"role": "user", "content": "Hi!"},
            {"role": "assistant", "content": [{"type": "output_text", "text": "Hello, how can I help?"}]},
            {"role": "user", "content": [{"type": "input_text", "text": QUESTION}]}]
    r = client.responses.create(model=served.model, instructions="Answer in one word.", input=conv,
                                max_output_tokens=2, temperature=0.0)
    expected = [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Hi!"},
                {"role": "assistant", "content": "Hello, how can I help?"}, {"role": "user", "content": QUESTION}]
    assert r.usage.input_tokens == _prompt_len(served, expected)
    assert r.instructions == "Answer in one word."


def test_previous_response_id_continues_the_conversation(client: openai.OpenAI, served: Any) -> None:
    first = client.responses.create(model=served.model, input=QUESTION, instructions="Be brief.",
                                    max_output_tokens=6, temperature=0.0)
    second = client.responses.create(model=served.model, input="And another one?", previous_response_id=first.id,
                                     max_output_tokens=4, temperature=0.0)
    # the earlier turn (input and output) comes first; its instructions do not carry over (OpenAI's rule)
    expected = [{"role": "user", "content": QUESTION}, {"role": "assistant", "content": first.output_text},
                {"role": "user", "content": "And another one?"}]
    assert second.usage.input_tokens == _prompt_len(served, expected)
    assert second.previous_response_id == first.id
    third = client.responses.create(model=served.model, input="Thanks.", previous_response_id=second.id,
                                    max_output_tokens=2, temperature=0.0)
    expected += [{"role": "assistant", "content": second.output_text}, {"role": "user", "content": "Thanks."}]
    assert third.usage.input_tokens == _prompt_len(served, expected)
    items = client.responses.input_items.list(second.id)
    assert [(i.type, i.role, i.content[0].text) for i in items.data] == [("message", "user", "And another one?")]
    got = client.responses.retrieve(first.id)
    assert got.id == first.id and got.output_text == first.output_text
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError) as e:
        client.responses.retrieve(first.id)
    assert e.value.status_code == 404
    with pytest.raises(openai.BadRequestError) as e:  # OpenAI's status and code for it
        client.responses.create(model=served.model, input="x", previous_response_id=first.id, max_output_tokens=2)
    assert e.value.body["code"] == "previous_response_not_found"
    assert e.value.body["param"] == "previous_response_id"


def test_stream_events_in_order(client: openai.OpenAI, served: Any) -> None:
    events = list(client.responses.create(model=served.model, input=QUESTION, max_output_tokens=GREEDY_MAX_TOKENS,
                                          temperature=0.0, stream=True))
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    assert types[:4] == head
    tail = ["response.output_text.done", "response.content_part.done", "response.output_item.done"]
    assert types[-4:-1] == tail and types[-1] in ("response.completed", "response.incomplete")
    assert set(types[4:-4]) == {"response.output_text.delta"}
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == served.expected_chat.outputs[0].text
    assert events[-4].text == text
    final = events[-1].response
    assert final.output_text == text and final.id == events[0].response.id
    assert final.usage.output_tokens == len(served.expected_chat.outputs[0].token_ids)
    assert client.responses.retrieve(final.id).output_text == text  # streamed responses are stored too


@pytest.mark.parametrize("parallel", [True, False])
def test_required_tool_choice_returns_valid_calls(client: openai.OpenAI, served: Any, parallel: bool) -> None:
    r = client.responses.create(model=served.model, input=ASK, tools=TOOLS, tool_choice="required",
                                parallel_tool_calls=parallel, max_output_tokens=120, temperature=0.0)
    assert r.status == "completed"
    calls = _check_calls(r.output)
    if not parallel:
        assert len(calls) == 1
    assert all(item.type == "function_call" for item in r.output)


def test_named_tool_choice_with_the_stream_helper(client: openai.OpenAI, served: Any) -> None:
    with client.responses.stream(model=served.model, input="Add 2 and 3.", tools=TOOLS, max_output_tokens=60,
                                 temperature=0.0, tool_choice={"type": "function", "name": "add"}) as stream:
        events = list(stream)
        final = stream.get_final_response()
    calls = _check_calls(final.output)
    assert [c.name for c in calls] == ["add"]
    args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert args == calls[0].arguments
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [calls[0].arguments]


def test_function_call_output_round_trip(client: openai.OpenAI, served: Any) -> None:
    first = client.responses.create(model=served.model, input=ASK, tools=TOOLS, max_output_tokens=60,
                                    temperature=0.0, tool_choice={"type": "function", "name": "get_weather"})
    call = _check_calls(first.output)[0]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temperature": 21}'}
    # by previous_response_id
    second = client.responses.create(model=served.model, input=[result], previous_response_id=first.id,
                                     tools=TOOLS, max_output_tokens=8, temperature=0.0)
    assert second.status in ("completed", "incomplete") and second.output[0].type == "message"
    # by hand: the earlier output items sent back as input
    by_hand = client.responses.create(model=served.model, input=[{"role": "user", "content": ASK}, *first.output,
                                                                 result],
                                      tools=TOOLS, max_output_tokens=8, temperature=0.0)
    assert by_hand.usage.input_tokens == second.usage.input_tokens
    assert by_hand.output_text == second.output_text
    # the tool result is in the prompt: a different result, a different prompt
    other = dict(result, output='{"temperature": -40, "note": "a cold day in Paris, unusually"}')
    third = client.responses.create(model=served.model, input=[other], previous_response_id=first.id,
                                    tools=TOOLS, max_output_tokens=1, temperature=0.0)
    assert third.usage.input_tokens > second.usage.input_tokens


def test_bad_input_is_a_400(client: openai.OpenAI, served: Any) -> None:
    def bad(param: str | None, **kw: Any) -> None:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model=served.model, **{"input": ASK, "max_output_tokens": 4, **kw})
        assert e.value.status_code == 400
        if param is not None:
            assert e.value.body["param"] == param, e.value.body

    bad("tool_choice", tools=TOOLS, tool_choice={"type": "function", "name": "nope"})
    bad("tools.0.parameters", tools=[{"type": "function", "name": "f", "parameters": {"type": 5}}])
    bad(None, input=[{"type": "input_image", "image_url": "http://x"}])
    bad(None, input=[{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}])
    bad("input.0.call_id", input=[{"type": "function_call_output", "call_id": "call_x", "output": "1"}])
    bad("input.0.arguments", input=[{"type": "function_call", "call_id": "c", "name": "add", "arguments": "[1]"}])
    bad("tool_choice", tool_choice="required")
    bad("text.format", tools=TOOLS, tool_choice="required",
        text={"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}})
    bad("max_output_tokens", max_output_tokens=10**6)
    bad(None, tools=[{"type": "web_search"}])


def test_text_format_json_schema(client: openai.OpenAI, served: Any) -> None:
    schema = {"type": "object", "properties": {"color": {"type": "string", "enum": ["red", "blue", "yellow"]}},
              "required": ["color"], "additionalProperties": False}
    r = client.responses.create(model=served.model, input=QUESTION, max_output_tokens=40, temperature=0.0,
                                text={"format": {"type": "json_schema", "name": "color", "schema": schema,
                                                 "strict": True}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), schema)
    assert r.text.format.type == "json_schema"
    with pytest.raises(openai.BadRequestError) as e:
        client.responses.create(model=served.model, input=QUESTION, max_output_tokens=4,
                                text={"format": {"type": "json_schema", "name": "x", "schema": {"type": 5}}})
    assert e.value.body["param"] == "text.format"


def test_parse_helper_with_a_pydantic_format(client: openai.OpenAI, served: Any) -> None:
    from typing import Literal

    from pydantic import BaseModel

    class Color(BaseModel):
        color: Literal["red", "blue", "yellow"]

    r = client.responses.parse(model=served.model, input=QUESTION, text_format=Color, max_output_tokens=40,
                               temperature=0.0)
    assert isinstance(r.output_parsed, Color)


def test_cli_flags_are_checked() -> None:
    import argparse

    from tokenfab.server.cli import add_arguments, run

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--responses-store-size", "7", "--responses-ttl", "60"])
    assert (args.responses_store_size, args.responses_ttl) == (7, 60.0)
    assert run(parser.parse_args(["--responses-store-size", "-1"])) == 2  # refused before any model loads
    assert run(parser.parse_args(["--responses-ttl", "0"])) == 2


# ---- fake engine: fast, in process ----
def test_malformed_bodies_over_http() -> None:
    with fake_server() as (c, _):
        assert_error(c.post("/v1/responses", json={}), 400, "input")
        assert_error(c.post("/v1/responses", json={"input": ""}), 400)
        assert_error(c.post("/v1/responses", json={"input": []}), 400)
        assert_error(c.post("/v1/responses", json={"input": "x", "background": True}), 400, "background")
        assert_error(c.post("/v1/responses", json={"input": [{"type": "item_reference", "id": "x"}]}), 400)
        assert_error(c.post("/v1/responses", json={"input": [{"role": "tool", "content": "x"}]}), 400)
        assert_error(c.post("/v1/responses", json={"input": "x", "text": {"format": {"type": "json_schema"}}}),
                     400, "text.format.schema")
        assert_error(c.post("/v1/responses", content=b"{not json", headers={"Content-Type": "application/json"}),
                     400)
        err = assert_error(c.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_0"}), 400,
                           "previous_response_id")
        assert err["code"] == "previous_response_not_found"
        assert_error(c.get("/v1/responses/resp_0"), 404)
        assert_error(c.delete("/v1/responses/resp_0"), 404)


def test_openapi_documents_the_routes() -> None:
    with fake_server() as (c, _):
        doc = c.get("/openapi.json").json()
    post = doc["paths"]["/v1/responses"]["post"]
    assert post["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/ResponseObject")
    assert "text/event-stream" in post["responses"]["200"]["content"]
    assert {"400", "413", "429", "500", "503"} <= set(post["responses"]) and "422" not in post["responses"]
    for method in ("get", "delete"):
        assert "404" in doc["paths"]["/v1/responses/{response_id}"][method]["responses"]
    request = doc["components"]["schemas"]["ResponsesRequest"]
    assert request["additionalProperties"] is False
    assert request["properties"]["model"]["anyOf"][0]["enum"] == ["fake-model"]


def test_store_bound_and_store_false_over_http() -> None:
    with fake_server(ServerConfig(drain_timeout=1, responses_store_size=1)) as (c, _):
        a = c.post("/v1/responses", json={"input": "a", "max_output_tokens": 2}).json()
        b = c.post("/v1/responses", json={"input": "b", "max_output_tokens": 2}).json()
        assert c.get(f"/v1/responses/{b['id']}").json()["id"] == b["id"]
        assert_error(c.get(f"/v1/responses/{a['id']}"), 404)  # evicted: the store holds one
        n = c.post("/v1/responses", json={"input": "n", "max_output_tokens": 2, "store": False}).json()
        assert n["store"] is False
        assert_error(c.get(f"/v1/responses/{n['id']}"), 404)
        assert c.get(f"/v1/responses/{b['id']}").status_code == 200  # not pushed out by an unstored response
        r = c.post("/v1/responses", json={"input": "c", "max_output_tokens": 2, "previous_response_id": b["id"]})
        assert r.status_code == 200 and r.json()["usage"]["input_tokens"] > b["usage"]["input_tokens"]


def test_input_items_pages() -> None:
    with fake_server() as (c, _):
        items = [{"role": "user", "content": "a"}, {"type": "function_call", "call_id": "c1", "name": "f",
                                                    "arguments": "{}"},
                 {"type": "function_call_output", "call_id": "c1", "output": "1"},
                 {"role": "assistant", "content": [{"type": "output_text", "text": "b"}]}]
        r = c.post("/v1/responses", json={"input": items, "max_output_tokens": 2}).json()
        url = f"/v1/responses/{r['id']}/input_items"
        page = c.get(url).json()  # newest first by default
        assert [i["type"] for i in page["data"]] == ["message", "function_call_output", "function_call", "message"]
        assert page["has_more"] is False and page["first_id"] == page["data"][0]["id"]
        asc = c.get(url, params={"order": "asc", "limit": 2}).json()
        assert [i["type"] for i in asc["data"]] == ["message", "function_call"] and asc["has_more"] is True
        assert asc["data"][0]["content"] == [{"type": "input_text", "text": "a"}]
        rest = c.get(url, params={"order": "asc", "after": asc["last_id"]}).json()
        assert [i["type"] for i in rest["data"]] == ["function_call_output", "message"] and not rest["has_more"]
        assert len({i["id"] for i in page["data"]}) == 4
        assert_error(c.get(url, params={"limit": 0}), 400)
        assert_error(c.get(url, params={"after": "nope"}), 400, "after")
        assert_error(c.get("/v1/responses/resp_0/input_items"), 404)


def test_expired_previous_response_over_http() -> None:
    with fake_server(ServerConfig(drain_timeout=1, responses_ttl=0.2)) as (c, _):
        a = c.post("/v1/responses", json={"input": "a", "max_output_tokens": 2}).json()
        time.sleep(0.3)  # past its expiry (monotonic clock)
        err = assert_error(c.post("/v1/responses", json={"input": "b", "previous_response_id": a["id"]}), 400,
                           "previous_response_id")
        assert err["code"] == "previous_response_not_found"
        assert_error(c.get(f"/v1/responses/{a['id']}"), 404)


class ScriptedEngine(FakeEngine):
    """The fake engine, but every request generates ``script`` (one byte a step), then stops."""

    def __init__(self, script: str, **kw: Any) -> None:
        super().__init__(**kw)
        self.script = script

    def step(self) -> list[RequestOutput]:
        while self.waiting and len(self.running) < self.max_num_seqs:
            self.running.append(self.waiting.pop(0))
        time.sleep(self.step_time)
        outs = []
        for seq in list(self.running):
            tok = self.script.encode()[len(seq.out)] + 1
            seq.out.append(tok)
            seq.text = self.tokenizer.decode(seq.out)
            finish = None
            if len(seq.out) == len(self.script.encode()):
                finish = "stop"
            elif seq.params.max_tokens is not None and len(seq.out) >= seq.params.max_tokens:
                finish = "length"
            co = CompletionOutput(0, seq.text, list(seq.out), finish, None, None, seq.text[seq.emitted_text:],
                                  [tok])
            seq.emitted_text = len(seq.text)
            if finish:
                self.running.remove(seq)
            outs.append(RequestOutput(seq.rid, None, seq.prompt, [co], finish is not None))
        return outs


SCRIPT = ('<think>I should call it.</think>Checking.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n'
          '</tool_call>')


@pytest.fixture
def scripted() -> Any:
    fake = ScriptedEngine(SCRIPT, step_time=0.0)
    app = build_app(AsyncEngine(fake), ServerConfig(drain_timeout=1, reasoning_parser="deepseek_r1",
                                                    tool_call_parser="hermes"))
    from fastapi.testclient import TestClient

    with TestClient(app, raise_server_exceptions=False) as c:
        yield openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=c, max_retries=0), c


def test_reasoning_and_auto_tool_call_items(scripted: Any) -> None:
    oc, _ = scripted
    r = oc.responses.create(model="fake-model", input="add 2 and 3", tools=TOOLS, max_output_tokens=200)
    assert [item.type for item in r.output] == ["reasoning", "message", "function_call"]
    assert r.output[0].content[0].text == "I should call it."
    assert r.output[1].content[0].text == "Checking."
    assert (r.output[2].name, json.loads(r.output[2].arguments)) == ("add", {"a": 2, "b": 3})
    assert r.usage.output_tokens_details.reasoning_tokens == len(b"I should call it.")
    assert r.status == "completed"
    with oc.responses.stream(model="fake-model", input="add 2 and 3", tools=TOOLS, max_output_tokens=200) as s:
        events = list(s)
        final = s.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    types = [e.type for e in events]
    order = [t for i, t in enumerate(types) if i == 0 or types[i - 1] != t]  # runs of deltas collapsed
    assert order == [
        "response.created", "response.in_progress",
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.done", "response.content_part.done", "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "I should call it."
    assert json.loads(final.output[2].arguments) == {"a": 2, "b": 3}


def test_cut_by_max_output_tokens_is_incomplete(scripted: Any) -> None:
    oc, c = scripted
    r = oc.responses.create(model="fake-model", input="x", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert r.output[-1].status == "incomplete" and r.usage.output_tokens == 5
    body = c.post("/v1/responses", json={"input": "x", "max_output_tokens": 5, "stream": True}).text
    events = sse_events(body)
    assert events[-1] == "[DONE]" and events[-2]["type"] == "response.incomplete"
    assert events[-2]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}


def test_engine_failure_is_reported_not_hidden() -> None:
    with fake_server() as (c, _):
        assert_error(c.post("/v1/responses", json={"input": "POISON", "max_output_tokens": 4}), 500)
        events = sse_events(c.post("/v1/responses", json={"input": "POISON", "max_output_tokens": 4,
                                                          "stream": True}).text)
        assert [e if e == "[DONE]" else e["type"] for e in events][-3:] == ["error", "response.failed", "[DONE]"]
        assert events[-2]["response"]["status"] == "failed" and events[-2]["response"]["error"]["message"]
        assert c.post("/v1/responses", json={"input": "fine", "max_output_tokens": 2}).status_code == 200


def test_disconnect_aborts_the_request() -> None:
    fake = FakeEngine(step_time=0.01, max_model_len=100_000)
    engine = AsyncEngine(fake)
    server = LiveServer(build_app(engine, ServerConfig(drain_timeout=1)))
    try:
        payload = {"input": "tell me a story", "max_output_tokens": 50_000, "stream": True}
        with httpx.Client(base_url=server.url, timeout=30) as c, c.stream("POST", "/v1/responses", json=payload) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            deltas = 0
            for line in lines:
                deltas += '"response.output_text.delta"' in line
                if deltas >= 3:
                    break
            assert fake.has_unfinished_requests()
        deadline = time.monotonic() + 10
        while fake.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not fake.has_unfinished_requests(), "the request kept generating after the client left"
        assert fake.steps < 2000
        with pytest.raises(httpx.ReadTimeout), httpx.Client(base_url=server.url, timeout=0.5) as c:
            c.post("/v1/responses", json={**payload, "stream": False})  # not streamed: gone while it waits
        deadline = time.monotonic() + 10
        while fake.has_unfinished_requests() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not fake.has_unfinished_requests(), "the non-streamed request kept generating"
    finally:
        server.stop()


def test_fuzzed_items_never_5xx() -> None:
    """Plausible and hostile input items, tools and formats (hypothesis): every answer < 500 with OpenAI's error
    body on 4xx, every 200 valid against the documented model, every stream ends with [DONE]."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from tests.server.fuzzing import _check_error_body, _check_stream

    text = st.one_of(st.text(max_size=8), st.sampled_from(["\ud800", "", "{}", '{"a": 1}', "call_1", "😀"]))
    anything = st.recursive(st.none() | st.booleans() | st.integers(-3, 2**40) | text,
                            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                            max_leaves=8)
    part = st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "refusal", "input_image"])},
                                 optional={"text": text, "refusal": text, "annotations": anything})
    item = st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "developer", "tool"])},
                              optional={"content": st.one_of(text, st.lists(part, max_size=2)), "type": text,
                                        "id": text, "status": text}),
        st.fixed_dictionaries({"type": st.just("function_call"), "call_id": text, "name": text,
                               "arguments": text}),
        st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": text,
                               "output": st.one_of(text, st.lists(part, max_size=2))}),
        st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "item_reference", "web_search_call"])},
                              optional={"summary": anything, "content": anything}),
        anything)
    tool = st.one_of(st.fixed_dictionaries({"type": st.just("function"), "name": st.sampled_from(["f", "g", "a b"])},
                                           optional={"parameters": st.one_of(st.just({"type": "object"}), anything),
                                                     "strict": st.booleans()}), anything)
    body = st.fixed_dictionaries(
        {"input": st.one_of(text, st.lists(item, max_size=4), anything)},
        optional={"instructions": text, "tools": st.lists(tool, max_size=2),
                  "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required", "any"]),
                                           st.fixed_dictionaries({"type": st.just("function"),
                                                                  "name": st.sampled_from(["f", "zz"])})),
                  "max_output_tokens": st.integers(-1, 12), "stream": st.booleans(),
                  "previous_response_id": text, "store": st.booleans(), "reasoning": anything,
                  "text": st.one_of(st.fixed_dictionaries({"format": st.fixed_dictionaries(
                      {"type": st.sampled_from(["text", "json_object", "json_schema"])},
                      optional={"schema": anything, "name": text})}), anything),
                  "metadata": anything, "temperature": st.floats(-1, 3), "parallel_tool_calls": anything})
    with fake_server(ServerConfig(drain_timeout=0), step_time=0.0, max_model_len=96) as (c, _):
        @given(body=body)
        @settings(max_examples=150, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def fuzz(body: Any) -> None:
            resp = c.post("/v1/responses", content=json.dumps(body), headers={"Content-Type": "application/json"})
            statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1
            assert resp.status_code < 500, (body, resp.text[:500])
            assert _check_error_body(resp) is None, (body, resp.text[:500])
            assert _check_stream(resp) is None, (body, resp.text[-500:])
            if resp.status_code == 200 and "json" in resp.headers["content-type"]:
                ResponseObject.model_validate(resp.json())

        statuses: dict[int, int] = {}
        fuzz()
        assert c.get("/health").status_code == 200
    assert statuses.get(200, 0) >= 10 and statuses.get(400, 0) >= 10, statuses  # both paths were reached


# ---- units ----
def test_conversation_from_items_leaves_the_stored_history_alone() -> None:
    from tokenfab.server.responses_input import conversation
    from tokenfab.server.responses_protocol import ResponsesRequest

    call = {"id": "call_a", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    body = ResponsesRequest.model_validate({"input": [
        {"type": "function_call", "call_id": "call_b", "name": "g", "arguments": '{"x": 1}'},
        {"type": "function_call_output", "call_id": "call_a", "output": "A"},
        {"type": "function_call_output", "call_id": "call_b", "output": [{"type": "input_text", "text": "B"}]},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"role": "developer", "content": [{"type": "input_text", "text": "d1"}, {"type": "input_text", "text": "d2"}]},
    ]})
    conv = conversation(body, history)
    assert [m["role"] for m in conv] == ["user", "assistant", "tool", "tool", "developer"]
    assert [c["id"] for c in conv[1]["tool_calls"]] == ["call_a", "call_b"]  # joined the assistant turn
    assert (conv[2]["tool_call_id"], conv[3]["content"], conv[4]["content"]) == ("call_a", "B", "d1\nd2")
    assert history[1]["tool_calls"] == [call]  # not mutated



def test_store_lru_ttl_and_bytes() -> None:
    now = [0.0]
    store = ResponseStore(max_entries=2, ttl=10.0, max_bytes=10_000, clock=lambda: now[0])
    store.put("a", {"id": "a"}, [])
    store.put("b", {"id": "b"}, [])
    assert store.get("a") is not None  # a is now the most recently used
    store.put("c", {"id": "c"}, [])
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    now[0] = 9.9
    assert store.get("a") is not None
    now[0] = 10.0  # expiry counts from storing, not from the last use
    assert store.get("a") is None and store.get("c") is None and len(store) == 0
    store.put("big", {"x": "y" * 9000}, [])
    store.put("big2", {"x": "y" * 9000}, [])  # over the byte budget together: the older goes
    assert store.get("big") is None and store.get("big2") is not None
    assert not store.put("huge", {"x": "y" * 20_000}, []) and store.get("huge") is None
    assert store.delete("big2") and not store.delete("big2")
    assert not ResponseStore(max_entries=0).put("a", {}, [])
    with pytest.raises(ValueError):
        ResponseStore(ttl=0)


def test_event_builder_orders_items_and_numbers_events() -> None:
    b = EventBuilder()
    events = b.feed([{"reasoning_content": "th"}, {"reasoning_content": "ink"}, {"content": "Hi"},
                     {"tool_calls": [{"index": 0, "id": "call_1", "type": "function",
                                      "function": {"name": "f", "arguments": ""}}]},
                     {"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]},
                     {"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]},
                     {"tool_calls": [{"index": 1, "id": "call_2", "type": "function",
                                      "function": {"name": "g", "arguments": "{}"}}]}])
    events += b.close(incomplete=False)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [(it["type"], it["status"]) for it in b.items] == [("reasoning", "completed"), ("message", "completed"),
                                                             ("function_call", "completed"),
                                                             ("function_call", "completed")]
    assert b.items[0]["content"][0]["text"] == "think" and b.items[1]["content"][0]["text"] == "Hi"
    assert (b.items[2]["arguments"], b.items[3]["arguments"]) == ('{"a": 1}', "{}")
    done = [e for e in events if e["type"] == "response.output_item.done"]
    assert [e["output_index"] for e in done] == [0, 1, 2, 3] and [e["item"] for e in done] == b.items
    empty = EventBuilder()
    assert [e["type"] for e in empty.close(incomplete=True)][-1] == "response.output_item.done"
    assert empty.items[0]["type"] == "message" and empty.items[0]["status"] == "incomplete"


# ---- GPT-OSS (Harmony), a tiny random model: the Responses API is its native one ----
@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: Any) -> Any:
    if (why := harmony_vocab_missing()) is not None:
        pytest.skip(f"no offline o200k: {why}")
    from tests.server.harmony_model import save_tiny_gpt_oss
    from tokenfab import LLM

    path = save_tiny_gpt_oss(tmp_path_factory.mktemp("gpt_oss"))
    llm = LLM(model=str(path), max_model_len=512)
    server = LiveServer(build_app(AsyncEngine(llm.engine), ServerConfig(drain_timeout=5)))
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    server.stop()


def test_gpt_oss_prompt_is_harmony_and_calls_round_trip(gpt_oss: openai.OpenAI) -> None:
    from tokenfab.server.reasoning.harmony_prompt import render_gpt_oss_prompt

    weather = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Zürich"]}},
               "required": ["city"], "additionalProperties": False}
    tools = [{"type": "function", "name": "get_weather", "description": "Weather now", "parameters": weather}]
    chat_tools = [{"type": "function", "function": {k: v for k, v in tools[0].items() if k != "type"}}]
    ask = [{"role": "user", "content": "Weather in Zürich?"}]
    for effort in ("low", "high"):
        r = gpt_oss.responses.create(model=None, input="Weather in Zürich?", tools=tools, max_output_tokens=4,
                                     temperature=0.0, reasoning={"effort": effort})
        assert r.usage.input_tokens == len(render_gpt_oss_prompt(ask, chat_tools, effort))
    named = dict(model=None, input="Weather in Zürich?", tools=tools, max_output_tokens=40, temperature=0.0,
                 tool_choice={"type": "function", "name": "get_weather"})
    first = gpt_oss.responses.create(**named)
    [call] = [item for item in first.output if item.type == "function_call"]
    jsonschema.validate(json.loads(call.arguments), weather)
    with gpt_oss.responses.stream(**named) as s:
        final = s.get_final_response()
    assert [(i.name, i.arguments) for i in final.output if i.type == "function_call"] == [(call.name, call.arguments)]
    result = {"type": "function_call_output", "call_id": call.call_id, "output": '{"temp": 3}'}
    second = gpt_oss.responses.create(model=None, input=[result], previous_response_id=first.id, tools=tools,
                                      max_output_tokens=8, temperature=0.0)
    assert second.usage.input_tokens > first.usage.input_tokens
    streamed = list(gpt_oss.responses.create(model=None, input=[result], previous_response_id=first.id, tools=tools,
                                             max_output_tokens=8, temperature=0.0, stream=True))
    assert streamed[-1].response.usage.input_tokens == second.usage.input_tokens
    assert [i.type for i in streamed[-1].response.output] == [i.type for i in second.output]
    assert streamed[-1].response.output_text == second.output_text
