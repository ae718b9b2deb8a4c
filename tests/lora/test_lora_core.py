"""Multi-LoRA across the engine-core process boundary (``tokenfab serve``'s default): the LoRA request
travels in the "add" message and the core runs each request with its adapter. The core loop runs in a
thread here (same protocol, same ipc:// sockets, as in tests/engine/test_core_process.py)."""

from __future__ import annotations

import os
import threading
import time

import pytest
import zmq

from tests.lora.adapters import merged_greedy
from tokenfab.engine.core import ipc
from tokenfab.engine.core.client import EngineCoreClient
from tokenfab.engine.core.process import EngineCore
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.output_processor import TokenTexts
from tokenfab.engine.requests.lora_request import LoRARequest
from tokenfab.engine.requests.sampling_params import SamplingParams

pytest.importorskip("peft")

PROMPT = [9, 250, 3, 71, 71, 18]
N_NEW = 6


def test_lora_requests_through_the_core(lora_setup, tmp_path):
    base_dir, base, adapters = lora_setup
    engine = LLMEngine(model=base_dir, device="cpu", dtype="float32", enable_lora=True, max_loras=2,
                       num_kv_blocks=64, block_size=4, detokenize=False)
    engine.post.decode_one = TokenTexts(None)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    address = f"ipc://{tmp_path}/core.sock"
    sock.bind(address)
    thread = threading.Thread(target=EngineCore(engine, sock).run, daemon=True)
    thread.start()
    client = EngineCoreClient(address, os.getpid(), None, ready_timeout=30)
    try:
        assert client.lora_targets == engine.lora_targets  # an API server checks adapters against them
        params = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
        jobs = {"b": None, "x": LoRARequest("x", 1, str(adapters["x"])), "y": LoRARequest("y", 2, str(adapters["y"])),
                "bad": LoRARequest("bad", 3, str(tmp_path / "missing"))}
        for rid, lora in jobs.items():
            client.add_request(rid, PROMPT, params, lora_request=lora)
        final = {}
        deadline = time.monotonic() + 120
        while client.has_unfinished_requests():
            assert time.monotonic() < deadline
            for out in client.step():
                if out.finished:
                    final[out.request_id] = out
        for rid, name in (("b", None), ("x", "x"), ("y", "y")):
            want = merged_greedy(base, adapters.get(name), [PROMPT], N_NEW)[0]
            assert list(final[rid].outputs[0].token_ids) == want, rid
        assert final["bad"].outputs[0].finish_reason == "error"  # refused by the core, alone
    finally:
        client._send(ipc.encode("shutdown"))
        thread.join(10)
        client.close()
        sock.close(0)
        ctx.term()
