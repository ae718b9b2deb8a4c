"""`tokenfab bench serve`: against the live server (tiny workload: it is a command, not a benchmark
here), and against scripted fake servers for what a live one rarely shows: chunks carrying several
tokens, failed requests, a peer that cannot stream above concurrency 1."""

from __future__ import annotations

import json

import httpx
import pytest

from tokenfab.bench import serve
from tokenfab.bench.llama_cpp_peer import peer_payload
from tokenfab.bench.serve import markdown_table
from tokenfab.bench.serve_client import itls_per_token, tokens_per_chunk
from tokenfab.cli import main


def test_bench_serve_reports_table_json_and_plot(served, tmp_path, capsys):
    out_json, out_png = tmp_path / "serve.json", tmp_path / "serve.png"
    rc = main(["bench", "serve", "--base-url", f"{served.url}/v1", "--concurrency", "1,2", "--num-requests", "2",
               "--input-len", "16", "--output-len", "3", "--json", str(out_json), "--plot", str(out_png),
               "--settings", "dtype=float32"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "| concurrency |" in printed and "TTFT p50 / p90 / p99 (ms)" in printed
    report = json.loads(out_json.read_text())
    assert report["model"] == served.model
    assert report["servers"][0]["settings"] == {"dtype": "float32"}
    assert [(r["concurrency"], r["stream"]) for r in report["results"]] == [(1, True), (2, True)]
    for r in report["results"]:
        assert r["completed"] == 2 and r["failed"] == 0
        assert r["mean_output_tokens"] == 3  # ignore_eos: exactly max_tokens
        assert r["output_throughput"] > 0 and r["request_throughput"] > 0
        for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            assert 0 < r[key]["p50"] <= r[key]["p90"] <= r[key]["p99"]
    assert out_png.stat().st_size > 1000
    assert markdown_table(report["results"]).count("\n") == 3


def test_bench_serve_chat_endpoint(served, capsys):
    rc = main(["bench", "serve", "--base-url", served.url, "--endpoint", "chat", "--concurrency", "2",
               "--num-requests", "2", "--input-len", "8", "--output-len", "2", "--warmup", "0"])
    assert rc == 0
    assert "| 2 | yes | 2/2 |" in capsys.readouterr().out


def test_itl_per_token_not_per_chunk():
    # chunks at 1.0 s (1 token), 1.1 s (1 token), 1.5 s (4 tokens), 1.6 s (2 tokens)
    itls = itls_per_token([1.0, 1.1, 1.5, 1.6], [1, 1, 4, 2])
    assert itls == pytest.approx([0.1, 0.1, 0.1, 0.1, 0.1, 0.05, 0.05])
    assert len(itls) == 8 - 1 and sum(itls) == pytest.approx(1.6 - 1.0)  # mean ITL == TPOT
    # a first chunk of 3 tokens: two of them came with the first token
    assert itls_per_token([2.0, 2.4], [3, 2]) == pytest.approx([0.0, 0.0, 0.2, 0.2])


def test_tokens_per_chunk_sources():
    assert tokens_per_chunk(3, 6, [1, 4, 6]) == ([1.0, 3.0, 2.0], "usage")  # running usage, cumulative
    assert tokens_per_chunk(3, 3, [None] * 3) == ([1.0, 1.0, 1.0], "one per chunk")
    counts, how = tokens_per_chunk(3, 7, [None, None, None], [0.1, 0.3])
    assert how == "estimated" and counts == [1.0, 3.0, 3.0]
    # 4 tokens in 3 chunks: the extra token went with the chunk after the longer gap
    assert tokens_per_chunk(3, 4, [None] * 3, [0.1, 0.3]) == ([1.0, 1.0, 2.0], "estimated")
    assert tokens_per_chunk(3, 4, [None] * 3, [0.3, 0.1]) == ([1.0, 2.0, 1.0], "estimated")


def _sse(*msgs) -> bytes:
    return b"".join(b"data: " + json.dumps(m).encode() + b"\n\n" for m in msgs) + b"data: [DONE]\n\n"


class FakeServers:
    """Two OpenAI-ish servers behind one httpx transport: 'ours' streams 4 tokens in 3 chunks (one of
    2 tokens) and fails every request whose prompt holds `fail_word`; 'peer' answers non-streamed
    requests only when concurrency > 1 would matter (it rejects streams unless told otherwise)."""

    def __init__(self, fail_word: str | None = None) -> None:
        self.fail_word = fail_word
        self.seen: list[tuple[str, bool, dict]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = request.url.host
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": f"{host}-model"}]})
        body = json.loads(request.content)
        self.seen.append((host, body["stream"], body))
        if self.fail_word and self.fail_word in body["prompt"]:
            return httpx.Response(500, json={"error": {"message": "boom"}})
        n = body["max_tokens"]
        if not body["stream"]:
            return httpx.Response(200, json={"choices": [{"text": "abcd"[:n], "finish_reason": "length"}],
                                             "usage": {"prompt_tokens": 5, "completion_tokens": n}})
        chunks = [{"choices": [{"text": "a"}]}, {"choices": [{"text": "bc"}]},
                  {"choices": [{"text": "d", "finish_reason": "length"}]},
                  {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 4}}]
        return httpx.Response(200, content=_sse(*chunks), headers={"content-type": "text/event-stream"})


def _args(*extra: str):
    import argparse

    p = argparse.ArgumentParser()
    serve.add_arguments(p)
    return p.parse_args(["--base-url", "http://ours", "--num-requests", "3", "--output-len", "4",
                         "--input-len", "8", *extra])


def test_bench_serve_exits_nonzero_when_requests_fail(tmp_path, capsys):
    fake = FakeServers(fail_word="Request 1 ")
    out = tmp_path / "r.json"
    rc = serve.run(_args("--concurrency", "1", "--json", str(out)), transport=httpx.MockTransport(fake))
    assert rc == 1
    (row,) = json.loads(out.read_text())["results"]
    assert row["completed"] == 2 and row["failed"] == 1 and "HTTP 500" in row["errors"][0]
    assert "1 request(s) failed" in capsys.readouterr().err
    assert serve.run(_args("--concurrency", "1"), transport=httpx.MockTransport(FakeServers())) == 0


def test_bench_serve_peer_rows_like_for_like(tmp_path):
    fake = FakeServers()
    out = tmp_path / "r.json"
    rc = serve.run(_args("--concurrency", "1,2", "--peer-base-url", "http://peer/v1", "--peer-label", "peer",
                         "--peer-stream-up-to", "1", "--json", str(out), "--markdown", str(tmp_path / "r.md")),
                   transport=httpx.MockTransport(fake))
    assert rc == 0
    report = json.loads(out.read_text())
    rows = [(r["server"], r["concurrency"], r["stream"]) for r in report["results"]]
    # interleaved per level; where the peer is not streamed, ours gets a non-streamed row too
    assert rows == [("tokenfab", 1, True), ("peer", 1, True),
                    ("tokenfab", 2, True), ("peer", 2, False), ("tokenfab", 2, False)]
    for r in report["results"]:
        assert r["completed"] == 3 and r["mean_output_tokens"] == 4
        if r["stream"]:
            # 4 tokens in 3 chunks: 3 intervals per request, not 2
            assert r["token_counts"] == ["estimated"]
            assert r["itl_ms"]["p50"] is not None and r["ttft_ms"]["p50"] is not None
        else:
            assert r["ttft_ms"]["p50"] is None and r["itl_ms"]["p50"] is None and r["e2e_ms"]["p50"] > 0
    peer_bodies = [b for host, _, b in fake.seen if host == "peer"]
    ours_bodies = [b for host, _, b in fake.seen if host == "ours"]
    assert {b["prompt"] for b in peer_bodies} == {b["prompt"] for b in ours_bodies}  # same prompts, warm-up too
    assert all(b["model"] == "peer-model" for b in peer_bodies)
    assert [s["label"] for s in report["servers"]] == ["tokenfab", "peer"]
    md = (tmp_path / "r.md").read_text()
    assert "| peer | 2 | no | 3/3 |" in md and "streamed up to concurrency 1" in md


def test_llama_cpp_payload_asks_for_the_same_work():
    ours = {"model": "m", "prompt": "p", "max_tokens": 64, "stream": True, "temperature": 0.0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}
    p = peer_payload(ours)
    assert p["min_tokens"] == 64 and p["max_tokens"] == 64  # exactly max_tokens, its ignore_eos
    assert p["repeat_penalty"] == 1.0 and p["temperature"] == 0.0  # greedy, no penalty
    assert "ignore_eos" not in p and "stream_options" not in p
