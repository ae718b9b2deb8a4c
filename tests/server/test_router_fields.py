"""The fields the fleet's routers add (``server/router_fields.py``) and the routes they call (``fleet_routes.py``),
against the server alone: the request bodies below are the ones ``vllm-router`` 0.1.17 and ``sglang-router``
0.3.2 forwarded when they ran in front of this server (captured; ``test_routers.py`` runs the routers)."""

from __future__ import annotations

import pytest

from tests.server.inprocess import assert_error, fake_server, sse_events
from tokenfab.server.app import ServerConfig
from tokenfab.server.protocol import CompletionRequest

HI = [{"role": "user", "content": "hi"}]
# what each router sent for client.chat.completions.create(model, messages, max_tokens=4[, stream])
VLLM_ROUTER_CHAT = {"model": "fake-model", "messages": HI, "stream": False, "max_tokens": 4, "logprobs": False,
                    "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
                    "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
                    "return_hidden_states": False, "include_reasoning": True}
SGLANG_ROUTER_CHAT = {"messages": HI, "model": "fake-model", "logprobs": False, "max_completion_tokens": 4,
                      "stream": False, "no_stop_trim": False, "ignore_eos": False, "continue_final_message": False,
                      "skip_special_tokens": True, "separate_reasoning": True, "stream_reasoning": True,
                      "return_hidden_states": False}
# both routers sent this for client.completions.create(model, prompt="hi", max_tokens=4[, stream])
ROUTER_COMPLETION = {"model": "fake-model", "prompt": "hi", "max_tokens": 4, "stream": False, "echo": False,
                     "no_stop_trim": False, "ignore_eos": False, "skip_special_tokens": True,
                     "return_hidden_states": False}


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("url,body", [("/v1/chat/completions", VLLM_ROUTER_CHAT),
                                      ("/v1/chat/completions", SGLANG_ROUTER_CHAT),
                                      ("/v1/completions", ROUTER_COMPLETION)],
                         ids=["vllm-router-chat", "sglang-router-chat", "completion"])
def test_router_request_shapes_are_served(url, body, stream):
    with fake_server() as (client, _):
        resp = client.post(url, json={**body, "stream": stream, "seed": 3})
        assert resp.status_code == 200, resp.text
        if stream:
            events = sse_events(resp.text)
            assert events[-1] == "[DONE]" and len(events) > 2
        else:
            choice = resp.json()["choices"][0]
            assert (choice.get("text") or choice["message"]["content"]) and choice["finish_reason"] == "length"


def test_unknown_fields_are_still_refused_and_router_values_are_checked():
    with fake_server() as (client, _):
        assert_error(client.post("/v1/chat/completions", json={**VLLM_ROUTER_CHAT, "max_token": 4}), 400, "max_token")
        err = assert_error(client.post("/v1/chat/completions",
                                       json={**VLLM_ROUTER_CHAT, "return_hidden_states": True}),
                           400, "return_hidden_states")
        assert "hidden states" in err["message"]
        assert_error(client.post("/v1/completions", json={**ROUTER_COMPLETION, "no_stop_trim": "yes"}), 400,
                     "no_stop_trim")
        # chat-only router fields are not completion fields
        assert_error(client.post("/v1/completions", json={**ROUTER_COMPLETION, "include_reasoning": True}), 400,
                     "include_reasoning")


def test_no_stop_trim_keeps_the_stop_string():
    """SGLang's no_stop_trim is vLLM's include_stop_str_in_output (the engine's stop handling is tested there)."""
    with fake_server() as (client, _):
        server = client.app.state.server
        for extra, kept in (({}, False), ({"no_stop_trim": True}, True), ({"include_stop_str_in_output": True}, True)):
            body = CompletionRequest.model_validate({**ROUTER_COMPLETION, "stop": "ab", **extra})
            params = server.sampling_params(body, 4, None, None)
            assert params.include_stop_str_in_output is kept, extra


# The fake chat template renders "<user>x<think>\n" without a generation prompt: a prompt that ends with an open
# think block, so deepseek_r1's parser reads everything generated as reasoning.
THINKING = {"model": "fake-model", "messages": [{"role": "user", "content": "x<think>"}], "max_tokens": 6,
            "add_generation_prompt": False, "seed": 5}


@pytest.mark.parametrize("stream", [False, True])
def test_reasoning_fields_are_honoured(stream):
    with fake_server(ServerConfig(drain_timeout=1, reasoning_parser="deepseek_r1")) as (client, _):
        def answer(**extra):
            resp = client.post("/v1/chat/completions", json={**THINKING, **extra, "stream": stream})
            assert resp.status_code == 200, resp.text
            if not stream:
                return resp.json()["choices"][0]["message"]
            merged: dict = {}
            for event in sse_events(resp.text)[:-1]:
                for choice in event["choices"]:
                    for key, value in choice["delta"].items():
                        if isinstance(value, str):
                            merged[key] = merged.get(key, "") + value
            return merged

        default = answer()
        assert default["reasoning_content"] and not default.get("content")
        dropped = answer(include_reasoning=False)
        assert "reasoning_content" not in dropped and "reasoning" not in dropped and not dropped.get("content")
        inline = answer(separate_reasoning=False)
        assert inline["content"] == default["reasoning_content"] and not inline.get("reasoning_content")
        assert answer(stream_reasoning=False)["reasoning_content"] == default["reasoning_content"]


@pytest.mark.parametrize("shape", ["vllm-router", "sglang-router"])
def test_load_report_shapes(shape):
    with fake_server(ServerConfig(drain_timeout=1, load_report=shape)) as (client, fake):
        fake.stats.num_used_blocks, fake.stats.num_total_blocks, fake.stats.kv_cache_tokens = 3, 10, 160
        body = client.get("/get_load").json()
        if shape == "vllm-router":  # vllm-router reads the integer "load": sequences running + waiting
            assert isinstance(body["load"], int) and body["load"] >= 0
        else:  # sglang-router sums num_tokens over a list of data-parallel ranks
            assert isinstance(body, list) and body[0]["dp_rank"] == 0
            assert body[0]["num_tokens"] in (0, 48)  # 48 once the engine thread published the stats


def test_info_routes_and_generating_health_check():
    with fake_server() as (client, fake):
        for path in ("/get_server_info", "/server_info", "/get_model_info", "/model_info"):
            info = client.get(path).json()
            assert info["served_model_name"] == "fake-model" and info["model_path"] == "fake-model", path
        assert client.get("/get_server_info").json()["dp_size"] == 1
        assert client.get("/health_generate").json() == {"status": "ok"}
        fake.die_on_next_step = True
        assert_error(client.get("/health_generate"), 503)
        assert_error(client.get("/health_generate"), 503)  # dead: refused before anything is queued


def test_tokenize_takes_what_vllm_router_sends_for_a_chat():
    """vllm-router's kv_aware tokenizes a chat through /tokenize (after /v1/chat/completions/render, a 404 here):
    the token ids are the chat prompt's own."""
    with fake_server() as (client, _):
        body = {"model": "fake-model", "continue_final_message": False, "messages": HI}
        ids = client.post("/tokenize", json=body).json()["tokens"]
        usage = client.post("/v1/chat/completions", json={**VLLM_ROUTER_CHAT, "max_tokens": 1}).json()["usage"]
        assert len(ids) == usage["prompt_tokens"]
        cont = client.post("/tokenize", json={**body, "continue_final_message": True}).json()["tokens"]
        assert cont != ids and len(cont) < len(ids)  # no generation prompt after the last message
