"""A live server on a free localhost port (uvicorn in a background thread), on the bundled model.

The engine is loaded once per session through ``LLM`` and used offline first (the reference
outputs of the HTTP-vs-``LLM.generate`` test), then handed to the server: the same weights serve
both, and the model loads only once.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx
import openai
import pytest
import uvicorn

from tokenfab import LLM, SamplingParams
from tokenfab.engine.core.async_engine import AsyncEngine
from tokenfab.server.app import ServerConfig, build_app

MAX_MODEL_LEN = 1024
GREEDY_PROMPTS = ["The capital of France is", "def fibonacci(n):"]
GREEDY_CHAT = [{"role": "user", "content": "Name a primary color."}]
GREEDY_MAX_TOKENS = 8


class LiveServer:
    """uvicorn serving ``app`` on 127.0.0.1:<free port> in a daemon thread. ``lifespan="off"``: the app's
    lifespan is not run, so an app over an engine another server already runs (a second front end
    with other options over the session's engine) neither starts nor shuts it down."""

    def __init__(self, app: Any, lifespan: str = "auto") -> None:
        config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", access_log=False,
                                timeout_graceful_shutdown=5, lifespan=lifespan)
        self._sock = config.bind_socket()
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self._sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


@dataclass
class Served:
    url: str
    model: str
    llm: LLM
    engine: AsyncEngine
    expected_completions: list[Any]
    expected_chat: Any


@pytest.fixture(scope="session")
def served() -> Served:
    llm = LLM(max_model_len=MAX_MODEL_LEN)
    greedy = SamplingParams(temperature=0.0, max_tokens=GREEDY_MAX_TOKENS)
    expected = llm.generate(GREEDY_PROMPTS, greedy)
    expected_chat = llm.chat(GREEDY_CHAT, greedy)[0]
    engine = AsyncEngine(llm.engine)
    app = build_app(engine, ServerConfig(max_waiting=512, drain_timeout=5))
    server = LiveServer(app)
    yield Served(server.url, llm.engine.model_name, llm, engine, expected, expected_chat)
    server.stop()


@pytest.fixture(scope="session")
def client(served: Served) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="session")
def aclient_factory(served: Served):
    def make() -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=300)

    return make


@pytest.fixture(scope="session")
def http(served: Served) -> httpx.Client:
    with httpx.Client(base_url=served.url, timeout=120) as c:
        yield c


def metric(text: str, name: str) -> float:
    """The value of a (single-series) metric in Prometheus text format."""
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            return float(line.rsplit(" ", 1)[1])
    raise KeyError(name)
