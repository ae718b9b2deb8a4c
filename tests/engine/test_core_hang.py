"""A hung engine core (alive, not stepping) is found and reported like a crashed one.

The core's loop sends a heartbeat to every front end with requests in flight
(``core_process.EngineCore._heartbeat``); the client's watchdog declares the core hung after
``hang_timeout`` seconds of silence with requests outstanding: the stream in flight ends with
``EngineDeadError``, the engine turns dead (the server's 503), and the core is SIGKILLed, so a
SIGCONT resurrects nothing. A busy core that keeps beating, and an idle one that sends nothing
while no request is outstanding, are not hung.

The fast test uses a stand-in core process (answers the handshake, then only beats) so the bound
can be a fraction of a second; the slow one SIGSTOPs the real core of a live ``tokenfab serve``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading
import time

import httpx
import pytest
import zmq

from tests.engine.fake_core import fake_core_process
from tokenfab.engine.core import client as core_client
from tokenfab.engine.core import ipc
from tokenfab.engine.core.async_engine import AsyncEngine
from tokenfab.engine.core.client import EngineCoreClient, hang_timeout_from_env
from tokenfab.engine.core.process import BEAT_S, EngineCore
from tokenfab.engine.requests.errors import EngineDeadError
from tokenfab.engine.requests.sampling_params import SamplingParams

# answers hello; once a request arrives, beats (an empty outputs) every 0.1 s; requests never finish
_BEATING_LOOP = """
    working = set()
    while True:
        if sock.poll(100):
            ident, frame = sock.recv_multipart()
            tag = ipc.decode(frame)[0]
            if tag == "hello":
                sock.send_multipart([ident, ipc.encode("ready", info)])
            elif tag == "add":
                working.add(ident)
        for ident in working:
            sock.send_multipart([ident, ipc.encode("outputs", [], None)])
"""


@pytest.fixture
def beating_core(tmp_path):
    with fake_core_process(tmp_path, _BEATING_LOOP) as core:
        yield core


def test_sigstopped_core_is_declared_dead_and_killed(beating_core):
    """Idle silence and a beating busy core pass; SIGSTOP with a request in flight -> the stream
    errors, the engine is dead within the bound, the core is SIGKILLed; SIGCONT changes nothing."""
    address, proc = beating_core
    bound = 0.5
    client = EngineCoreClient(address, proc.pid, None, ready_timeout=60, hang_timeout=bound)
    engine = AsyncEngine(client)
    died = threading.Event()
    report = engine._backend_died
    client.on_dead = lambda e: (died.set(), report(e))

    async def scenario():
        await asyncio.sleep(3 * bound)  # no request outstanding: silence is not a hang
        assert not engine.is_dead
        stream = engine.add_request(None, [1, 2, 3], SamplingParams(max_tokens=5))
        await stream.wait_accepted()
        await asyncio.sleep(3 * bound)  # busy and beating: alive
        assert not engine.is_dead
        t0 = time.monotonic()
        proc.send_signal(signal.SIGSTOP)
        with pytest.raises(EngineDeadError, match="hung"):
            async with asyncio.timeout(10):
                async for _ in stream:
                    pass
        return time.monotonic() - t0

    try:
        took = asyncio.run(scenario())
        assert died.wait(5)  # on_dead runs on the client's thread: it may land just after the stream's error
        assert engine.is_dead and client.is_dead
        assert bound < took < bound + 3, took
        assert proc.wait(5) == -signal.SIGKILL  # killed, not merely abandoned
        try:
            proc.send_signal(signal.SIGCONT)  # no resurrection: the process is gone
        except ProcessLookupError:
            pass
        assert client.is_dead and engine.is_dead
        with pytest.raises(EngineDeadError, match="hung"):
            client.add_request("r2", [1], SamplingParams())
    finally:
        engine.shutdown()
        client.close()


def test_core_loop_beats_front_ends_with_requests_in_flight(monkeypatch):
    """The real loop's heartbeat: an empty outputs to each front end with a request in flight, at
    most every BEAT_S; none to a front end without one."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealers = []
    for name in (b"busy", b"idle"):
        d = ctx.socket(zmq.DEALER)
        d.setsockopt(zmq.IDENTITY, name)
        d.connect(f"tcp://127.0.0.1:{port}")
        dealers.append(d)
    try:
        for d in dealers:  # make both identities known to the router
            d.send(ipc.encode("hello"))
            assert router.poll(5000)
            router.recv_multipart()
        core = EngineCore(engine=None, sock=router)
        core._route["0:r"] = (b"busy", "r")
        now = [1000.0]
        monkeypatch.setattr("tokenfab.engine.core.process.time.monotonic", lambda: now[0])
        core._heartbeat()
        core._heartbeat()  # within BEAT_S: nothing more
        now[0] += BEAT_S
        core._heartbeat()
        busy, idle = dealers
        got = []
        while busy.poll(500):
            got.append(ipc.decode(busy.recv()))
        assert got == [("outputs", [[], None])] * 2
        assert not idle.poll(100)
    finally:
        for s in (*dealers, router):
            s.close(0)
        ctx.term()


def test_hang_timeout_setting(monkeypatch):
    monkeypatch.delenv("TOKENFAB_ENGINE_HANG_TIMEOUT", raising=False)
    assert hang_timeout_from_env() == core_client.HANG_TIMEOUT_S
    monkeypatch.setenv("TOKENFAB_ENGINE_HANG_TIMEOUT", "2.5")
    assert hang_timeout_from_env() == 2.5
    monkeypatch.setenv("TOKENFAB_ENGINE_HANG_TIMEOUT", "0")
    assert hang_timeout_from_env() == 0.0
    for bad in ("soon", "-1", "nan", "inf"):
        monkeypatch.setenv("TOKENFAB_ENGINE_HANG_TIMEOUT", bad)
        with pytest.raises(ValueError, match="TOKENFAB_ENGINE_HANG_TIMEOUT"):
            hang_timeout_from_env()


@pytest.mark.slow
def test_served_core_sigstopped_gives_503_within_seconds(monkeypatch):
    """``tokenfab serve`` on the bundled model, hang bound 3 s: SIGSTOP the core mid-stream -> the
    stream ends with an error, /health and new requests answer 503 (hung); SIGCONT: still 503."""
    from tests.server.test_cli_server import API_KEY, ServeProcess

    monkeypatch.setenv("TOKENFAB_ENGINE_HANG_TIMEOUT", "3")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    server = ServeProcess("--max-model-len", "512", "--no-access-log")
    core = int(re.search(r"engine core pid (\d+)", server.output).group(1))
    try:
        body = {"prompt": "Write a long story.", "max_tokens": 400, "stream": True, "ignore_eos": True}
        with httpx.Client(base_url=server.url, headers=headers, timeout=60) as c, \
                c.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()
            for line in lines:  # the first token
                if line.startswith("data: {") and json.loads(line[6:])["choices"][0]["text"]:
                    break
            t0 = time.monotonic()
            os.kill(core, signal.SIGSTOP)
            rest = list(lines)  # ends: no hang
            ended = time.monotonic() - t0
        assert 2 < ended < 15, ended
        errors = [json.loads(x[6:]) for x in rest if x.startswith("data: {") and '"error"' in x]
        assert errors and errors[-1]["error"]["code"] == "service_unavailable"
        for _ in range(2):  # before and after SIGCONT
            h = httpx.get(f"{server.url}/health")
            assert h.status_code == 503 and h.json()["error"]["code"] == "engine_dead"
            r = httpx.post(f"{server.url}/v1/completions", headers=headers, json={"prompt": "Hi", "max_tokens": 2})
            assert r.status_code == 503 and "hung" in r.json()["error"]["message"]
            try:
                os.kill(core, signal.SIGCONT)
            except ProcessLookupError:
                pass
            time.sleep(1.5)
        state = _proc_state(core)
        assert state in (None, "Z"), f"the hung core is still there (state {state})"
    finally:
        try:
            os.kill(core, signal.SIGCONT)
        except ProcessLookupError:
            pass
        server.stop()


def _proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return None
