"""/v1/files and /v1/batches over the session's engine (tokenfab/server/batch/), through the official `openai`
client: upload, list, retrieve, content, delete; a batch's output equal to the same requests sent online (greedy),
a body the endpoint rejects in the error file with its custom_id; cancel mid-way; hostile inputs answered with
4xx bodies or a failed batch that names the bad lines, never a 500."""

from __future__ import annotations

import io
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import LiveServer
from tests.server.inprocess import assert_error
from tokenfab.server.app import ServerConfig, build_app
from tokenfab.server.batch.config import BatchConfig

PROMPTS = ["Name a primary color.", "What is 2 + 2?", "Say hello.", "Name a fruit."]


@pytest.fixture(scope="module")
def batch_server(served, tmp_path_factory) -> Iterator[LiveServer]:
    """A second front end over the session's engine (its lifespan off: the engine is the session's), with the
    Files/Batches API on a fresh data dir, a 64 KiB upload limit and 2 batch lines at once."""
    config = BatchConfig(data_dir=tmp_path_factory.mktemp("batch-data"), max_file_bytes=64 << 10, concurrency=2)
    app = build_app(served.engine, ServerConfig(max_waiting=512, drain_timeout=5), config)
    server = LiveServer(app, lifespan="off")
    yield server
    server.stop()
    app.state.server.close()
    app.state.batches.db.close()


@pytest.fixture(scope="module")
def bc(batch_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{batch_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _jsonl(lines: list[Any]) -> bytes:
    return "".join((json.dumps(x) if not isinstance(x, str) else x) + "\n" for x in lines).encode()


def _chat_line(custom_id: str, content: str, model: str, **extra: Any) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": content}], "max_tokens": 8,
            "temperature": 0.0, **extra}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def _upload(client: openai.OpenAI, data: bytes, purpose: str = "batch") -> Any:
    return client.files.create(file=("input.jsonl", io.BytesIO(data)), purpose=purpose)


def _wait(client: openai.OpenAI, batch_id: str, until: tuple[str, ...], timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in until:
            return batch
        assert time.monotonic() < deadline, f"batch still {batch.status}"
        time.sleep(0.1)


def _lines(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    return [] if file_id is None else [json.loads(x) for x in client.files.content(file_id).text.splitlines()]


def test_files_upload_list_retrieve_content_delete(bc):
    data = _jsonl([{"a": 1}, {"b": 2}])
    f = _upload(bc, data, "user_data")
    assert f.id.startswith("file-") and f.object == "file" and f.bytes == len(data)
    assert (f.filename, f.purpose, f.status) == ("input.jsonl", "user_data", "processed")
    assert bc.files.retrieve(f.id).model_dump() == f.model_dump()
    assert bc.files.content(f.id).content == data
    g = _upload(bc, b"{}\n", "fine-tune")
    listed = [x.id for x in bc.files.list(purpose="user_data")]
    assert f.id in listed and g.id not in listed
    newest_first = [x.id for x in bc.files.list(limit=2).data]
    assert newest_first[0] == g.id
    page = bc.files.list(order="asc", limit=1, after=f.id)
    assert g.id in [x.id for x in page.data] or page.has_more
    assert bc.files.delete(f.id).deleted
    with pytest.raises(openai.NotFoundError):
        bc.files.retrieve(f.id)
    with pytest.raises(openai.NotFoundError):
        bc.files.content(f.id)


def test_batch_output_equals_online_and_rejected_bodies_land_in_the_error_file(bc, client, served):
    lines = [_chat_line(f"req-{i}", p, served.model) for i, p in enumerate(PROMPTS)]
    lines.insert(2, _chat_line("bad-temperature", "hi", served.model, temperature=-3))
    lines.append(_chat_line("bad-model", "hi", "no-such-model"))
    f = _upload(bc, _jsonl(lines))
    batch = bc.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h",
                              metadata={"job": "test"})
    assert batch.status == "validating" and batch.id.startswith("batch_") and batch.metadata == {"job": "test"}
    done = _wait(bc, batch.id, ("completed", "failed"))
    assert done.status == "completed", done
    assert done.request_counts.model_dump() == {"total": 6, "completed": 4, "failed": 2}
    assert done.in_progress_at and done.finalizing_at and done.completed_at and done.model == served.model
    output = _lines(bc, done.output_file_id)
    assert [x["custom_id"] for x in output] == [f"req-{i}" for i in range(4)]  # input order, each once
    for line, prompt in zip(output, PROMPTS):
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        assert body["object"] == "chat.completion" and line["response"]["request_id"] == body["id"]
        online = client.chat.completions.create(model=served.model, messages=[{"role": "user", "content": prompt}],
                                                max_tokens=8, temperature=0.0)
        assert body["choices"][0]["message"]["content"] == online.choices[0].message.content
    assert done.usage.input_tokens == sum(x["response"]["body"]["usage"]["prompt_tokens"] for x in output)
    assert done.usage.output_tokens == sum(x["response"]["body"]["usage"]["completion_tokens"] for x in output) > 0
    assert done.usage.total_tokens == done.usage.input_tokens + done.usage.output_tokens
    errors = {x["custom_id"]: x for x in _lines(bc, done.error_file_id)}
    assert set(errors) == {"bad-temperature", "bad-model"}
    for line in errors.values():
        assert line["response"]["status_code"] == 400
        assert set(line["response"]["body"]["error"]) == {"message", "type", "param", "code"}
    assert errors["bad-model"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert bc.files.retrieve(done.output_file_id).purpose == "batch_output"
    assert batch.id in [b.id for b in bc.batches.list(limit=100)]


def test_completions_endpoint_batch(bc, client, served):
    line = {"custom_id": "c0", "method": "POST", "url": "/v1/completions",
            "body": {"model": served.model, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}}
    f = _upload(bc, _jsonl([line]))
    done = _wait(bc, bc.batches.create(input_file_id=f.id, endpoint="/v1/completions",
                                       completion_window="24h").id, ("completed", "failed"))
    [out] = _lines(bc, done.output_file_id)
    online = client.completions.create(model=served.model, prompt="The capital of France is", max_tokens=6,
                                       temperature=0)
    assert out["response"]["body"]["choices"][0]["text"] == online.choices[0].text
    with pytest.raises(openai.ConflictError):  # a finished batch cannot be cancelled
        bc.batches.cancel(done.id)


def test_cancel_mid_batch(bc, served):
    lines = [_chat_line(f"r{i}", f"Count to {i}.", served.model, max_tokens=48) for i in range(40)]
    f = _upload(bc, _jsonl(lines))
    batch = bc.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
    _wait(bc, batch.id, ("in_progress",))
    cancelling = bc.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = _wait(bc, batch.id, ("cancelled",))
    assert done.cancelled_at and done.request_counts.completed < 40
    output = _lines(bc, done.output_file_id)
    assert len(output) == done.request_counts.completed
    assert len({x["custom_id"] for x in output}) == len(output)


def _failed_batch(bc, data: bytes, endpoint: str = "/v1/chat/completions") -> list[dict[str, Any]]:
    f = _upload(bc, data)
    batch = bc.batches.create(input_file_id=f.id, endpoint=endpoint, completion_window="24h")
    assert batch.status == "failed" and batch.failed_at, batch
    return [e.model_dump() for e in batch.errors.data]


def test_bad_lines_fail_the_batch_by_line_number(bc, served):
    good = _chat_line("a", "hi", served.model)
    errors = _failed_batch(bc, b"this is not json\n" + _jsonl([good, "[1, 2]"]))
    assert [(e["line"], e["code"]) for e in errors] == [(1, "invalid_json_line"), (3, "invalid_json_line")]
    errors = _failed_batch(bc, _jsonl([good, good]))
    assert [(e["line"], e["code"]) for e in errors] == [(2, "duplicate_custom_id")]
    wrong_url = {**_chat_line("b", "hi", served.model), "url": "/v1/completions"}
    errors = _failed_batch(bc, _jsonl([good, wrong_url]))
    assert [(e["line"], e["code"]) for e in errors] == [(2, "mismatched_url")]
    missing = [{k: v for k, v in _chat_line(f"m{k}", "hi", served.model).items() if k != drop}
               for k, drop in enumerate(("custom_id", "method", "url", "body"))]
    errors = _failed_batch(bc, _jsonl(missing))
    assert [(e["line"], e["param"]) for e in errors] == [(1, "custom_id"), (2, "method"), (3, "url"), (4, "body")]
    errors = _failed_batch(bc, b"\n\n")
    assert errors[0]["code"] == "empty_file"
    errors = _failed_batch(bc, b"\xff\xfe\x00garbage\n")
    assert errors[0]["line"] == 1


def test_hostile_requests_are_4xx_with_openai_bodies(bc, batch_server, served):
    url = batch_server.url
    with httpx.Client(base_url=url, timeout=30) as http:
        assert_error(http.post("/v1/files", files={"file": ("x", b"0" * (80 << 10))}, data={"purpose": "batch"}),
                     413, "file")
        assert_error(http.post("/v1/files", files={"file": ("x", b"{}")}, data={"purpose": "homework"}), 400,
                     "purpose")
        assert_error(http.post("/v1/files", data={"purpose": "batch"}), 400, "file")
        assert_error(http.post("/v1/files", json={"purpose": "batch"}), 400, "file")
        assert_error(http.post("/v1/files", content=b"--x\r\ngarbage", headers={
            "content-type": "multipart/form-data; boundary=x"}), 400)
        assert_error(http.get("/v1/files/file-nope"), 404, "file_id")
        assert_error(http.get("/v1/files/file-nope/content"), 404, "file_id")
        assert_error(http.delete("/v1/files/file-nope"), 404, "file_id")
        assert_error(http.get("/v1/batches/batch_nope"), 404, "batch_id")
        assert_error(http.post("/v1/batches/batch_nope/cancel"), 404, "batch_id")
        assert_error(http.get("/v1/files", params={"limit": 0}), 400)
        assert_error(http.get("/v1/batches", params={"after": "batch_nope"}), 400, "after")
        body = {"input_file_id": "file-nope", "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        assert_error(http.post("/v1/batches", json=body), 404, "input_file_id")
        tuning = _upload(openai.OpenAI(base_url=f"{url}/v1", api_key="x"), b"{}\n", "fine-tune")
        assert_error(http.post("/v1/batches", json={**body, "input_file_id": tuning.id}), 400, "input_file_id")
        assert_error(http.post("/v1/batches", json={**body, "input_file_id": tuning.id,
                                                    "endpoint": "/v1/embeddings"}), 400, "endpoint")
        assert_error(http.post("/v1/batches", json={**body, "input_file_id": tuning.id,
                                                    "completion_window": "1h"}), 400, "completion_window")
        assert_error(http.post("/v1/batches", json={**body, "metadata": {"k": 1}}), 400, "metadata")
        assert_error(http.post("/v1/batches", json={"endpoint": "/v1/chat/completions"}), 400)
        assert_error(http.post("/v1/batches", content=b"{not json"), 400)
        # an input still in use by an unfinished batch is not deleted under it
        busy = _upload(openai.OpenAI(base_url=f"{url}/v1", api_key="x"),
                       _jsonl([_chat_line(f"z{i}", "Tell a long story.", served.model, max_tokens=64)
                               for i in range(8)]))
        made = http.post("/v1/batches", json={**body, "input_file_id": busy.id}).json()
        assert_error(http.delete(f"/v1/files/{busy.id}"), 409, "file_id")
        http.post(f"/v1/batches/{made['id']}/cancel")
