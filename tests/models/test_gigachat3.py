"""GigaChat3 (Lightning 10B-A1.8B, Ultra 702B-A36B) in its published layout (tests/models/wrapped_layouts.py):
``model_type: deepseek_v3`` / ``DeepseekV3ForCausalLM`` (transformers 5.24 has no GigaChat module: the model
runs as DeepSeek-V3) with ``num_nextn_predict_layers: 1`` and the MTP layer stored as decoder layer
``num_hidden_layers``.

- greedy tokens equal transformers' (fp32) alone and batched with prompts of different lengths; the MTP
  layer is kept aside, never run as a decoder layer;
- MTP speculation through tokenfab/speculative/mtp.py (k = 2 drafts from the one layer) gives the plain
  greedy tokens alone and batched;
- the ``gigachat3`` tool parser end to end through /v1/chat/completions: a tiny model in the same layout
  whose greedy output is forced to ``function call<|role_sep|>\\n{"name": ..., "arguments": ...}`` (its chat
  template names the marker, so the parser is picked from it, no flag), non-streamed and streamed.
"""

from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from tests.models.wrapped_layouts import FORCED_TEXT, GIGACHAT3, write_forced_gigachat3, write_gigachat3
from tests.server.inprocess import sse_events
from tests.speculative.spec_cases import outputs, plain_llm, random_prompts, record_drafts
from tests.tiny_models import assert_batched_equals_alone, greedy_tokens, hf_logits, small_engine
from tokenfab import LLM
from tokenfab.engine.core.async_engine import AsyncEngine
from tokenfab.server.app import ServerConfig, build_app

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11], [1, 2, 3], list(range(30, 60))]
STEPS = 6
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]


@pytest.fixture(scope="module")
def giga(tmp_path_factory):
    path = tmp_path_factory.mktemp("gigachat3")
    hf, _, _ = write_gigachat3(path, q_lora_rank=None)  # plain q_proj (the q_lora path is in test_kimi_k25)
    return hf, path


def test_published_layout_greedy_equals_transformers_alone_and_batched(giga):
    hf, path = giga
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v3" and cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    engine = small_engine(path)
    model = engine.runner.model
    n = GIGACHAT3["num_hidden_layers"]
    assert len(model.model.layers) == n
    assert model.mtp_weights and all(k.startswith(f"model.layers.{n}.") for k in model.mtp_weights)
    ref = []
    for ids in PROMPTS:
        out = list(ids)
        for _ in range(STEPS):
            out.append(int(hf_logits(hf, out)[-1].argmax()))
        ref.append(out[len(ids):])
    assert [greedy_tokens(engine, [p], STEPS, f"a{i}")[0] for i, p in enumerate(PROMPTS)] == ref
    assert greedy_tokens(engine, PROMPTS, STEPS, "b") == ref
    assert_batched_equals_alone(engine)


def test_mtp_speculation_equals_plain_greedy(giga):
    _, path = giga
    kw = dict(block_size=4, num_kv_blocks=128)
    spec = LLM(model=str(path), speculative_config={"method": "mtp", "num_speculative_tokens": 2}, **kw)
    plain = plain_llm(str(path), **kw)
    seen = record_drafts(spec)
    prompts = random_prompts(320, (3, 14, 27))
    ref = outputs(plain, prompts, 10)
    assert [outputs(spec, [p], 10)[0] for p in prompts] == ref
    assert outputs(spec, prompts, 10) == ref
    assert seen and max(len(d) for _, d in seen) == 2  # the MTP layer drafted (up to) 2 tokens a step


@pytest.fixture(scope="module")
def chat(tmp_path_factory):
    path = write_forced_gigachat3(tmp_path_factory.mktemp("gigachat3_forced"))
    llm = LLM(model=str(path), block_size=4, num_kv_blocks=64)
    app = build_app(AsyncEngine(llm.engine), ServerConfig(drain_timeout=1))
    with TestClient(app, raise_server_exceptions=False) as client:
        yield client, llm.engine.model_name


def _ask(chat: tuple[TestClient, str], **kw):
    client, name = chat
    body = {"model": name, "messages": [{"role": "user", "content": "add one and two"}], "max_tokens": 20,
            "temperature": 0, **kw}
    return client.post("/v1/chat/completions", json=body)


def test_forced_output_without_tools_is_the_call_text(chat):
    r = _ask(chat)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["message"]["content"] == FORCED_TEXT and choice["finish_reason"] == "stop"


def test_gigachat3_tool_call_through_the_chat_endpoint(chat):
    r = _ask(chat, tools=TOOLS)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert not choice["message"]["content"]
    [call] = choice["message"]["tool_calls"]
    assert call["function"]["name"] == "add" and json.loads(call["function"]["arguments"]) == {"a": 1, "b": 2}


def test_gigachat3_tool_call_streamed(chat):
    r = _ask(chat, tools=TOOLS, stream=True)
    assert r.status_code == 200, r.text
    content, args, names, finish = "", "", [], None
    for ev in sse_events(r.text):
        if ev == "[DONE]":
            continue
        for ch in ev["choices"]:
            content += ch["delta"].get("content") or ""
            for tc in ch["delta"].get("tool_calls") or ():
                names += [tc["function"]["name"]] if tc["function"].get("name") else []
                args += tc["function"].get("arguments") or ""
            finish = ch.get("finish_reason") or finish
    assert names == ["add"] and json.loads(args) == {"a": 1, "b": 2}
    assert content == "" and finish == "tool_calls"
