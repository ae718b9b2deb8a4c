"""`tokenfab bench serve --llama-server`: llama.cpp's native llama-server (parallel slots, continuous
batching) as the peer, streamed at every concurrency. The request adaptation, the errors before
anything starts, the wiring against scripted fake servers, and one short live run against the real
llama-server when ``scripts/llama_cpp_server.sh build-tools`` has built it."""

from __future__ import annotations

import argparse
import json
import os

import httpx
import pytest

from tokenfab.bench import llama_server_peer, serve
from tokenfab.bench.llama_server_peer import server_payload
from tokenfab.cli import main

from .test_bench_serve import FakeServers

_HAVE_SERVER = os.access(llama_server_peer.binary(), os.X_OK)


def test_llama_server_payload_asks_for_the_same_work():
    ours = {"model": "m", "prompt": "p", "max_tokens": 64, "stream": True, "temperature": 0.0, "ignore_eos": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    p = server_payload(ours)
    assert p["n_predict"] == 64 and p["max_tokens"] == 64 and p["ignore_eos"] is True  # exactly max_tokens
    assert p["temperature"] == 0.0 and p["repeat_penalty"] == 1.0  # greedy, no penalty
    assert p["stream_options"] == {"include_usage": True}  # final usage; no running usage in llama-server
    assert p["prompt"] == "p" and p["stream"] is True
    plain = server_payload({"model": "m", "prompt": "p", "max_tokens": 8, "stream": False, "temperature": 0.0})
    assert "stream_options" not in plain and "ignore_eos" not in plain and plain["n_predict"] == 8
    assert ours["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}  # not mutated


def test_llama_server_missing_binary_is_a_clear_error(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("LLAMA_CPP_TOOLS", str(tmp_path / "no-tools"))
    rc = main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--llama-server"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "scripts/llama_cpp_server.sh build-tools" in err and str(tmp_path / "no-tools" / "bin") in err


def test_llama_server_excludes_the_other_peers(capsys):
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    with pytest.raises(SystemExit) as e:
        parser.parse_args(["--llama-server", "--llama-cpp"])
    assert e.value.code == 2 and "not allowed with argument" in capsys.readouterr().err
    args = parser.parse_args(["--llama-server", "--peer-base-url", "http://peer"])
    assert serve.run(args) == 2
    assert "--llama-server: not allowed with --peer-base-url" in capsys.readouterr().err


class _FakeLlamaServer:
    """Stands in for `LlamaServer`: the 'peer' host of `FakeServers`, which streams at any concurrency."""

    started: list[_FakeLlamaServer] = []

    def __init__(self, parallel: int | None = None) -> None:
        self.parallel, self.url, self.stopped = parallel or 16, "http://peer", False
        self.started.append(self)

    def stop(self) -> None:
        self.stopped = True


def test_llama_server_streamed_at_every_level(tmp_path, monkeypatch):
    monkeypatch.setattr(llama_server_peer, "missing_binary_message", lambda: None)
    monkeypatch.setattr(llama_server_peer, "LlamaServer", _FakeLlamaServer)
    monkeypatch.setattr(llama_server_peer, "settings", lambda parallel, url: {"n_parallel": parallel, "url": url})
    fake, out = FakeServers(), tmp_path / "r.json"
    parser = argparse.ArgumentParser()
    serve.add_arguments(parser)
    args = parser.parse_args(["--base-url", "http://ours", "--num-requests", "3", "--output-len", "4", "--input-len",
                              "8", "--concurrency", "1,2", "--llama-server", "--llama-server-parallel", "4",
                              "--json", str(out)])
    assert serve.run(args, transport=httpx.MockTransport(fake)) == 0
    (launched,) = _FakeLlamaServer.started[-1:]
    assert launched.parallel == 4 and launched.stopped
    report = json.loads(out.read_text())
    assert [(r["server"], r["concurrency"], r["stream"]) for r in report["results"]] == [
        ("tokenfab", 1, True), ("llama-server", 1, True), ("tokenfab", 2, True), ("llama-server", 2, True)]
    assert report["servers"][1]["settings"] == {"n_parallel": 4, "url": "http://peer"}
    assert report["servers"][1]["streamed_up_to_concurrency"] is None
    peer_bodies = [b for host, _, b in fake.seen if host == "peer"]
    assert peer_bodies and all(b["n_predict"] == 4 and b["ignore_eos"] and b["repeat_penalty"] == 1.0
                               for b in peer_bodies)
    for r in report["results"]:
        assert r["completed"] == 3 and r["failed"] == 0 and r["itl_ms"]["p50"] is not None


@pytest.mark.skipif(not _HAVE_SERVER, reason=f"no {llama_server_peer.binary()}: "
                    "run scripts/llama_cpp_server.sh build-tools to build llama.cpp's llama-server")
def test_llama_server_live(served, tmp_path, monkeypatch):
    started: list[llama_server_peer.LlamaServer] = []

    class Recorded(llama_server_peer.LlamaServer):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            started.append(self)

    monkeypatch.setattr(llama_server_peer, "LlamaServer", Recorded)
    # its OpenMP threads sleep between requests instead of spinning on the cores our in-process server
    # needs (measured on 2 shared cores: this test's call 4 s with PASSIVE, 42 s without)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    out = tmp_path / "live.json"
    rc = main(["bench", "serve", "--base-url", served.url, "--concurrency", "1,2", "--num-requests", "2",
               "--input-len", "16", "--output-len", "8", "--llama-server", "--llama-server-parallel", "2",
               "--json", str(out)])
    assert rc == 0
    (launched,) = started
    assert launched.proc.poll() is not None  # stopped at the end
    report = json.loads(out.read_text())
    assert [(r["server"], r["concurrency"], r["stream"]) for r in report["results"]] == [
        ("tokenfab", 1, True), ("llama-server", 1, True), ("tokenfab", 2, True), ("llama-server", 2, True)]
    for r in report["results"]:
        assert r["completed"] == 2 and r["failed"] == 0, r["errors"]
        assert r["mean_output_tokens"] == 8  # ignore_eos / n_predict: exactly max_tokens on both
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert r[key]["p50"] is not None and 0 <= r[key]["p50"] <= r[key]["p99"], key
    peer = report["servers"][1]["settings"]
    assert peer["n_parallel"] == 2 and peer["total_slots"] == 2 and peer["continuous_batching"] is True
    assert peer["version"].startswith("version:") and "GGML_AMX_TILE=OFF" in peer["cmake_args"]
    assert peer["binary"] == str(llama_server_peer.binary()) and peer["n_threads"] >= 1
    assert peer["OMP_WAIT_POLICY"] == "PASSIVE"
