"""The batch worker without an engine (a counting stand-in for the line runner): stopped mid-batch, with a torn
last line in its result file as a crash leaves it, and resumed by a new worker (another owner, after the lease)
on the same database and data directory, each custom_id is run once and published once; a 503 from the engine
leaves the line pending; a lease held by a live owner is not taken. The slow twin kills a real server:
test_batch_restart.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import sqlite3
from pathlib import Path
from typing import Any

import pytest

from tests.server.postgres import postgres_url
from tokenfab.server.batch import worker as worker_module
from tokenfab.server.batch.batches import BatchStore
from tokenfab.server.batch.config import BatchConfig
from tokenfab.server.batch.db import BatchRow, Database
from tokenfab.server.batch.files import FileStore
from tokenfab.server.batch.worker import BatchWorker

LINES = 12
URL = "/v1/completions"


class CountingRunner:
    def __init__(self, fail_with_503: set[str] = frozenset()) -> None:  # type: ignore[assignment]
        self.calls: list[str] = []
        self.fail = set(fail_with_503)

    async def run(self, url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        await asyncio.sleep(0.01)
        self.calls.append(body["prompt"])
        if body["prompt"] in self.fail:
            self.fail.discard(body["prompt"])
            return 503, {"error": {"message": "engine dead", "type": "server_error", "param": None, "code": None}}
        if body["prompt"] == "bad":
            return 400, {"error": {"message": "no", "type": "invalid_request_error", "param": "x", "code": None}}
        return 200, {"id": "cmpl-" + body["prompt"], "choices": [{"text": body["prompt"]}],
                     "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}


def _setup(tmp: Path, url: str | None = None) -> tuple[Database, FileStore, BatchStore, BatchConfig]:
    config = BatchConfig(data_dir=tmp, database_url=url, concurrency=3, lease_seconds=0.2)
    db = Database(config.url)
    files = FileStore(db, tmp)
    return db, files, BatchStore(db, files), config


async def _create(files: FileStore, batches: BatchStore, prompts: list[str]) -> str:
    data = "".join(json.dumps({"custom_id": f"c{i}", "method": "POST", "url": URL, "body": {"prompt": p}}) + "\n"
                   for i, p in enumerate(prompts))
    src = files.root / "upload.tmp"
    src.write_text(data)
    row = await files.add(src, "in.jsonl", "batch")
    return (await batches.create(row.id, URL, "24h", None))["id"]


async def _until(batches: BatchStore, batch_id: str, check: Any, timeout: float = 20) -> dict[str, Any]:
    for _ in range(int(timeout / 0.02)):
        batch = await batches.retrieve(batch_id)
        if check(batch):
            return batch
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out: {batch}")


def _published(files: FileStore, file_id: str) -> list[dict[str, Any]]:
    path = files.root / "files" / file_id
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_stopped_mid_batch_then_resumed_runs_each_line_once(tmp_path):
    asyncio.run(_stopped_then_resumed(tmp_path, None))


def test_the_same_on_postgresql(tmp_path):
    """Several API servers share one PostgreSQL: the same model code, the same resume, on a real server."""
    with postgres_url() as url:
        asyncio.run(_stopped_then_resumed(tmp_path, url))


async def _stopped_then_resumed(tmp_path: Path, url: str | None) -> None:
    db, files, batches, config = _setup(tmp_path, url)
    prompts = [f"p{i}" for i in range(LINES)]
    prompts[5] = "bad"
    batch_id = await _create(files, batches, prompts)
    runner = CountingRunner()
    first = BatchWorker(db, files, runner, config)  # type: ignore[arg-type]
    first.start()
    await _until(batches, batch_id, lambda b: b["request_counts"]["completed"] >= 4)
    task = first._task
    assert task is not None
    task.cancel()  # its lines in flight are cut off, nothing is finalized
    with contextlib.suppress(asyncio.CancelledError):
        await task
    partial = tmp_path / "batches" / batch_id / "output.jsonl"
    with open(partial, "ab") as f:  # the crash tore the line being written
        f.write(b'{"id": "batch_req_x", "custom_id": "c11", "resp')
    done_before = partial.read_bytes().count(b"\n") + (tmp_path / "batches" / batch_id / "errors.jsonl"
                                                       ).read_bytes().count(b"\n")
    assert 4 <= done_before < LINES
    second = BatchWorker(db, files, runner, config)  # type: ignore[arg-type]
    second.start()
    batch = await _until(batches, batch_id, lambda b: b["status"] == "completed")
    await second.stop()
    assert batch["request_counts"] == {"total": LINES, "completed": LINES - 1, "failed": 1}
    ran = list(runner.calls)
    in_flight_when_stopped = len(ran) - LINES  # lines cancelled mid-run by the crash run again, once
    assert sorted(set(ran)) == sorted(prompts) and 0 <= in_flight_when_stopped <= config.concurrency
    output = _published(files, batch["output_file_id"])
    assert [x["custom_id"] for x in output] == [f"c{i}" for i in range(LINES) if i != 5]
    assert output[0]["response"]["request_id"] == "cmpl-p0"
    assert output[0]["response"]["body"]["choices"] == [{"text": "p0"}]
    usage = batch["usage"]  # summed over the answered lines, the resumed ones counted from the result file
    assert (usage["input_tokens"], usage["output_tokens"]) == (3 * (LINES - 1), 2 * (LINES - 1))
    [error] = _published(files, batch["error_file_id"])
    assert error["custom_id"] == "c5" and error["response"]["status_code"] == 400
    appended = [json.loads(x)["custom_id"] for x in partial.read_text().splitlines()]
    assert sorted(appended) == sorted(f"c{i}" for i in range(LINES) if i != 5)  # the torn line was cut
    db.close()


def test_engine_503_leaves_the_line_pending_and_a_live_lease_is_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(worker_module, "ENGINE_RETRY_SECONDS", 0.05)

    async def main() -> None:
        db, files, batches, config = _setup(tmp_path)
        config.lease_seconds = 30.0
        batch_id = await _create(files, batches, ["a", "b", "c"])
        runner = CountingRunner(fail_with_503={"b"})
        worker = BatchWorker(db, files, runner, config)  # type: ignore[arg-type]
        rival = BatchWorker(db, files, runner, config)  # type: ignore[arg-type]
        assert await db.run(worker._claim) == batch_id
        assert await db.run(rival._claim) is None  # held, lease fresh
        await db.run(lambda s: worker._release(batch_id, s))
        worker.start()
        batch = await _until(batches, batch_id, lambda b: b["status"] == "completed", timeout=30)
        await worker.stop()
        assert batch["request_counts"] == {"total": 3, "completed": 3, "failed": 0}
        assert runner.calls.count("b") == 2  # the 503 did not consume the line: it ran again
        db.close()

    asyncio.run(main())


def test_an_unreadable_input_fails_the_batch_not_the_worker(tmp_path):
    async def main() -> None:
        db, files, batches, config = _setup(tmp_path)
        batch_id = await _create(files, batches, ["a"])
        for path in (tmp_path / "files").iterdir():  # the input's bytes gone from under the store
            path.unlink()
        worker = BatchWorker(db, files, CountingRunner(), config)  # type: ignore[arg-type]
        worker.start()
        batch = await _until(batches, batch_id, lambda b: b["status"] == "failed")
        second = await _create(files, batches, ["b"])  # the worker goes on with the next batch
        assert (await _until(batches, second, lambda b: b["status"] == "completed"))["request_counts"]["completed"] == 1
        await worker.stop()
        assert batch["errors"]["data"][0]["code"] == "input_file_unreadable"
        db.close()

    asyncio.run(main())


def test_a_database_with_an_older_schema_is_refused_at_start(tmp_path):
    con = sqlite3.connect(tmp_path / "old.db")
    con.execute("CREATE TABLE tokenfab_files (id VARCHAR(64) PRIMARY KEY)")
    con.commit()
    con.close()
    with pytest.raises(RuntimeError, match="older schema"):
        Database(f"sqlite:///{tmp_path / 'old.db'}")


def test_a_batch_past_its_window_expires_with_what_it_answered(tmp_path):
    async def main() -> None:
        db, files, batches, config = _setup(tmp_path)
        batch_id = await _create(files, batches, ["a", "b"])
        await db.run(lambda s: setattr(s.get(BatchRow, batch_id), "expires_at", 0))
        worker = BatchWorker(db, files, CountingRunner(), config)  # type: ignore[arg-type]
        worker.start()
        batch = await _until(batches, batch_id, lambda b: b["status"] == "expired")
        await worker.stop()
        assert batch["expired_at"] and batch["output_file_id"] is None and batch["request_counts"]["completed"] == 0
        db.close()

    asyncio.run(main())
