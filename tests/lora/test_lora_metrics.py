"""LoRA series on /metrics: vLLM's ``vllm:lora_requests_info`` (labels ``max_lora``, ``running_lora_adapters``,
``waiting_lora_adapters``; the value the time of the reading) and our ``tokenfab_lora_*``, scraped while adapter
requests run, parsed with prometheus_client's own parser; the engine's per-adapter counts they come from."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.server.conftest import LiveServer
from tokenfab.engine.core.async_engine import AsyncEngine
from tokenfab.engine.core.dp_client import merge_stats
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.requests.lora_request import LoRARequest
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.server.app import ServerConfig, build_app

pytest.importorskip("peft")

PROMPT = [5, 17, 33, 2, 90, 41, 7]


def scrape(url: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=30).text):
        for sample in family.samples:
            out.setdefault(sample.name, []).append((sample.labels, sample.value))
    return out


def test_engine_counts_sequences_per_adapter(lora_chat_setup):
    """Three adapters' requests and the base's at --max-loras 2: per-adapter counts of waiting, then running
    sequences, the third adapter's (held back by --max-loras) as waiting; the base's not counted; a DP server's
    merged stats add them name by name."""
    base_dir, _, _, adapters = lora_chat_setup
    engine = LLMEngine(model=base_dir, device="cpu", dtype="float32", enable_lora=True, max_loras=2,
                       max_lora_rank=16, num_kv_blocks=64, block_size=4)
    x, y, z = (LoRARequest(n, i + 1, str(adapters[n])) for i, n in enumerate("xyz"))
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for i, lora in enumerate((x, x, y, z, None)):
        engine.add_request(f"r{i}", PROMPT, params, lora_request=lora)
    s = engine.get_stats()
    assert (s.running_lora_adapters, s.waiting_lora_adapters) == ({}, {"x": 2, "y": 1, "z": 1})
    engine.step()
    s = engine.get_stats()
    assert s.num_running == 5  # z's sequence holds its blocks in the running list, but did not run
    assert (s.running_lora_adapters, s.waiting_lora_adapters) == ({"x": 2, "y": 1}, {"z": 1})
    merged = merge_stats([s, s])
    assert merged.running_lora_adapters == {"x": 4, "y": 2} and merged.waiting_lora_adapters == {"z": 2}
    while engine.has_unfinished_requests():
        engine.step()
    s = engine.get_stats()
    assert (s.running_lora_adapters, s.waiting_lora_adapters) == ({}, {})


def test_lora_series_while_adapter_requests_run(lora_chat_setup):
    """Streams on adapters x, y, z and the base at --max-loras 2: while they run, vLLM's labels name two running
    adapters and the third waiting, and our per-adapter gauges agree; idle, both are empty."""
    base_dir, _, _, adapters = lora_chat_setup
    engine = LLMEngine(model=base_dir, device="cpu", dtype="float32", enable_lora=True, max_loras=2,
                       max_lora_rank=16, num_kv_blocks=256, block_size=4, served_model_name="base")
    config = ServerConfig(enable_lora=True, max_lora_rank=16, max_loras=2,
                          lora_modules=[f"x={adapters['x']}", f"y={adapters['y']}"])
    server = LiveServer(build_app(AsyncEngine(engine), config))
    try:
        idle = scrape(server.url)
        (labels, stamp), = idle["vllm:lora_requests_info"]
        assert labels == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
        assert abs(stamp - time.time()) < 60  # the time of the reading, as vLLM's set_to_current_time
        assert idle["tokenfab_lora_adapters_loaded"] == [({"model_name": "base"}, 2.0)]
        r = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "z", "lora_path": str(adapters["z"])})
        assert r.status_code == 200, r.text
        assert scrape(server.url)["tokenfab_lora_adapters_loaded"] == [({"model_name": "base"}, 3.0)]
        errors: list[str] = []

        def stream(model: str) -> None:
            body = {"model": model, "prompt": "Tell me a story", "max_tokens": 200, "ignore_eos": True,
                    "temperature": 0.0, "stream": True}
            with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=300) as resp:
                if resp.status_code != 200:
                    errors.append(resp.read().decode())
                for _ in resp.iter_lines():
                    pass

        threads = [threading.Thread(target=stream, args=(m,)) for m in ("x", "y", "z", "base")]
        for t in threads:
            t.start()
        agreeing = []  # scrapes with two adapters running and one waiting, ours saying the same
        while any(t.is_alive() for t in threads):
            s = scrape(server.url)
            (labels, _), = s["vllm:lora_requests_info"]
            running = set(filter(None, labels["running_lora_adapters"].split(",")))
            waiting = set(filter(None, labels["waiting_lora_adapters"].split(",")))
            ours = {kind: {lb["lora_name"] for lb, v in s[f"tokenfab_lora_requests_{kind}"] if v == 1.0}
                    for kind in ("running", "waiting")}
            if len(running) == 2 and len(waiting) == 1 and running | waiting == {"x", "y", "z"}:
                agreeing.append(ours == {"running": running, "waiting": waiting})
        for t in threads:
            t.join()
        assert not errors, errors
        assert any(agreeing), agreeing
        end = scrape(server.url)
        (labels, _), = end["vllm:lora_requests_info"]
        assert labels == {"max_lora": "2", "running_lora_adapters": "", "waiting_lora_adapters": ""}
        assert sorted(lb["lora_name"] for lb, v in end["tokenfab_lora_requests_running"] if v == 0.0) == ["x", "y", "z"]
    finally:
        server.stop()
