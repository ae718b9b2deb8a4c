"""Multi-LoRA over HTTP (vLLM's API): the official ``openai`` client picks adapters with ``model``;
``/v1/models`` lists them with ``parent``; ``/v1/load_lora_adapter`` / ``unload_lora_adapter`` through httpx,
with their error statuses and OpenAI error bodies."""

from __future__ import annotations

import argparse
import asyncio

import httpx
import openai
import pytest

from tests.lora.adapters import merged_greedy
from tests.server.conftest import LiveServer
from tokenfab.engine.args import EngineArgs
from tokenfab.engine.core.async_engine import AsyncEngine
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.server.app import ServerConfig, build_app
from tokenfab.server.cli import add_arguments
from tokenfab.server.lora_registry import parse_lora_module

pytest.importorskip("peft")

N_NEW = 6
PROMPT = [5, 17, 33, 2, 90, 41, 7]


@pytest.fixture(scope="module")
def live(lora_chat_setup):
    base_dir, base, tokenizer, adapters = lora_chat_setup
    engine = LLMEngine(model=base_dir, device="cpu", dtype="float32", enable_lora=True, max_loras=2,
                       max_lora_rank=8, num_kv_blocks=64, block_size=4, served_model_name="base")
    config = ServerConfig(enable_lora=True, max_lora_rank=8,
                          lora_modules=[f"x={adapters['x']}", f'{{"name": "y", "path": "{adapters["y"]}"}}'])
    server = LiveServer(build_app(AsyncEngine(engine), config))
    chat_text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    chat_ids = tokenizer.encode(chat_text, add_special_tokens=False)  # as the server tokenizes a rendered chat
    prompt_ids = tokenizer.encode(PROMPT_TEXT)
    refs = {}
    for n in (None, "x", "y"):
        ids = merged_greedy(base, adapters.get(n), [prompt_ids, chat_ids], N_NEW)
        refs[n] = [tokenizer.decode(i, skip_special_tokens=True) for i in ids]
    yield server, adapters, refs
    server.stop()


PROMPT_TEXT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a primary color."}]


def test_model_picks_the_adapter(live):
    """completions, chat and responses with model = base / x / y in one batch each: each the text of
    transformers' greedy tokens with that adapter merged by PEFT."""
    server, _, refs = live
    client = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    assert refs["x"] != refs[None] and refs["y"] != refs[None]  # the adapters change the output
    extra = {"ignore_eos": True}

    async def run():
        calls = []
        for m in ("base", "x", "y"):
            calls.append(client.completions.create(model=m, prompt=PROMPT_TEXT, max_tokens=N_NEW, temperature=0.0,
                                                   extra_body=extra))
            calls.append(client.chat.completions.create(model=m, messages=CHAT, max_tokens=N_NEW, temperature=0.0,
                                                        extra_body=extra))
            calls.append(client.responses.create(model=m, input=CHAT, max_output_tokens=N_NEW, temperature=0.0))
        return await asyncio.gather(*calls)

    out = asyncio.run(run())
    for k, m in enumerate((None, "x", "y")):
        comp, chat, resp = out[3 * k : 3 * k + 3]
        assert comp.choices[0].text == refs[m][0], m
        assert chat.choices[0].message.content == refs[m][1], m
        assert resp.output_text == refs[m][1], m
        assert comp.model == chat.model == resp.model == (m or "base")  # the adapter's name, as vLLM answers


def test_models_lists_adapters_with_parent(live):
    server, adapters, _ = live
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) >= {"base", "x", "y"}
    assert cards["x"].parent == "base" and cards["x"].root == str(adapters["x"])
    assert cards["base"].parent is None


def test_load_unload_over_http(live):
    server, adapters, _ = live
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    with httpx.Client(base_url=server.url, timeout=120) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "x2", "lora_path": str(adapters["x"])})
        assert r.status_code == 200 and r.text.startswith("Success"), r.text
        assert "x2" in {m.id for m in client.models.list().data}
        out = client.completions.create(model="x2", prompt=[PROMPT], max_tokens=2, temperature=0.0)
        assert out.choices[0].finish_reason == "length"
        dup = http.post("/v1/load_lora_adapter", json={"lora_name": "x2", "lora_path": str(adapters["y"])})
        assert dup.status_code == 400 and "already been loaded" in dup.json()["error"]["message"]
        r = http.post("/v1/unload_lora_adapter", json={"lora_name": "x2"})
        assert r.status_code == 200 and r.text.startswith("Success")
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="x2", prompt=[PROMPT], max_tokens=2)
        assert e.value.body["code"] == "model_not_found"
        gone = http.post("/v1/unload_lora_adapter", json={"lora_name": "x2"})
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "lora_adapter_not_found"


@pytest.mark.parametrize("body,status,fragment", [
    ({"lora_name": "bad", "lora_path": "/nonexistent/adapter"}, 400, "no adapter"),
    ({"lora_name": "z", "lora_path": None}, 400, ""),  # filled in below: rank 16 > --max-lora-rank 8
    ({"lora_name": "nopath"}, 400, ""),
    ({"lora_path": "/tmp"}, 400, ""),
    ({"lora_name": "", "lora_path": "/tmp"}, 400, "lora_name"),
    ({"lora_name": "base", "lora_path": "/tmp"}, 400, "base model"),
    ({"lora_name": "q", "lora_path": "/tmp", "extra": 1}, 400, ""),
    ({"lora_name": 7, "lora_path": "/tmp"}, 400, ""),
    ({"lora_name": ["q"], "lora_path": "/tmp"}, 400, ""),
    ('{"lora_name": "q", "lora_path": "/tmp/\\u0000x"}', 400, ""),  # raw JSON text from here on
    ('{"lora_name": "q\\ud800", "lora_path": "/tmp"}', 400, ""),
    ("[1, 2]", 400, ""),
    ("{not json", 400, ""),
])
def test_hostile_loads_are_4xx(live, body, status, fragment):
    server, adapters, _ = live
    if isinstance(body, dict) and body.get("lora_name") == "z":
        body = {"lora_name": "z", "lora_path": str(adapters["z"])}
        fragment = "max-lora-rank"
    with httpx.Client(base_url=server.url, timeout=60) as http:
        if isinstance(body, str):
            r = http.post("/v1/load_lora_adapter", content=body, headers={"Content-Type": "application/json"})
        else:
            r = http.post("/v1/load_lora_adapter", json=body)
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert fragment in err["message"] and err["type"]
        assert http.get("/health").status_code == 200
        names = {m["id"] for m in http.get("/v1/models").json()["data"]}
        assert not names & {"bad", "z", "nopath", "", "q"}


def test_unknown_adapter_and_not_enabled(live, lora_chat_setup):
    server, _, _ = live
    with httpx.Client(base_url=server.url, timeout=60) as http:
        r = http.post("/v1/completions", json={"model": "nope", "prompt": PROMPT, "max_tokens": 1})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"
    base_dir = lora_chat_setup[0]
    plain = LiveServer(build_app(AsyncEngine(LLMEngine(model=base_dir, device="cpu", dtype="float32",
                                                       num_kv_blocks=16)), ServerConfig()))
    try:
        with httpx.Client(base_url=plain.url, timeout=60) as http:
            assert http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"}).status_code == 404
    finally:
        plain.stop()


def test_streamed_chat_with_an_adapter(live):
    server, _, refs = live
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
    chunks = list(client.chat.completions.create(model="x", messages=CHAT, max_tokens=N_NEW, temperature=0.0,
                                                 stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == refs["x"][1]
    assert {c.model for c in chunks} == {"x"}


def test_cli_flags_and_lora_module_forms():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["m", "--enable-lora", "--lora-modules", "a=/p/a", '{"name": "b", "path": "/p/b", '
                              '"base_model_name": "m"}', "--max-loras", "4", "--max-lora-rank", "64",
                              "--max-cpu-loras", "8"])
    ea = EngineArgs.from_cli_args(args)
    assert (ea.enable_lora, ea.max_loras, ea.max_lora_rank, ea.max_cpu_loras) == (True, 4, 64, 8)
    assert [parse_lora_module(s) for s in ea.lora_modules] == [("a", "/p/a", None), ("b", "/p/b", "m")]
    for bad in ("noequals", "=path", "name=", '{"name": "x"}', '{"name": "x", "path": "/p", "extra": 1}', "{bad"):
        with pytest.raises(ValueError, match="--lora-modules"):
            parse_lora_module(bad)


def test_retrieve_an_adapter_and_the_openapi_model_field(live):
    server, adapters, _ = live
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
    card = client.models.retrieve("y")
    assert card.id == "y" and card.parent == "base" and card.root == str(adapters["y"])
    assert client.models.retrieve("base").parent is None
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("nope")
    with httpx.Client(base_url=server.url, timeout=60) as http:
        doc = http.get("/openapi.json").json()
    model = doc["components"]["schemas"]["ChatCompletionRequest"]["properties"]["model"]
    assert "base" not in str(model)  # adapters come and go: not a fixed list of names


def test_an_adapter_for_another_model_is_refused_at_load(live, lora_setup):
    """Its config is fine; its tensors (a 64-wide model's) do not fit this 32-wide model: the load is a 400
    naming the module (checked against the engine's LoRA targets), and the server goes on serving."""
    server, _, refs = live
    foreign = lora_setup[2]["x"]
    with httpx.Client(base_url=server.url, timeout=120) as http:
        r = http.post("/v1/load_lora_adapter", json={"lora_name": "foreign", "lora_path": str(foreign)})
        assert r.status_code == 400 and "do not fit" in r.json()["error"]["message"], r.text
        r = http.post("/v1/completions", json={"model": "foreign", "prompt": PROMPT_TEXT, "max_tokens": 2})
        assert r.status_code == 400 and r.json()["error"]["code"] == "model_not_found"
        r = http.post("/v1/completions", json={"model": "x", "prompt": PROMPT_TEXT, "max_tokens": N_NEW,
                                               "temperature": 0.0, "ignore_eos": True})
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == refs["x"][0]
        long = http.post("/v1/load_lora_adapter", json={"lora_name": "n" * 300, "lora_path": str(foreign)})
        assert long.status_code == 400


def test_broken_adapter_files_are_4xx(live, tmp_path):
    server, _, _ = live
    garbage = tmp_path / "garbage"
    garbage.mkdir()
    (garbage / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8}')
    (garbage / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    pickled = tmp_path / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    (pickled / "adapter_model.bin").write_bytes(b"not read")
    huge = tmp_path / "huge"
    huge.mkdir()
    (huge / "adapter_config.json").write_text('{"peft_type": "LORA", "pad": "' + "x" * (2 << 20) + '"}')
    dora = tmp_path / "dora"
    dora.mkdir()
    (dora / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "use_dora": true}')
    cases = [(garbage, "cannot read"), (pickled, "pickle"), (huge, "larger than"), (dora, "use_dora"),
             (garbage / "adapter_config.json", "not a directory")]
    with httpx.Client(base_url=server.url, timeout=60) as http:
        for i, (path, fragment) in enumerate(cases):
            r = http.post("/v1/load_lora_adapter", json={"lora_name": f"broken{i}", "lora_path": str(path)})
            assert r.status_code == 400 and fragment in r.json()["error"]["message"], (path, r.text)
        assert http.get("/health").status_code == 200
