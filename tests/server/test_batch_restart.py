"""Durability of /v1/batches: `tokenfab serve` killed with SIGKILL mid-batch and started again on the same data
directory resumes the batch, and every custom_id is answered exactly once: in the published output file, and in
the result file the lines were appended to as they finished (no line ran twice, none was lost). Its fast twin over
the same worker code, without an engine: test_batch_worker.py."""

from __future__ import annotations

import io
import json
import signal
import time
from pathlib import Path

import openai
import pytest

from tests.server.test_cli_server import API_KEY, ServeProcess

LINES = 24


def _serve(data_dir: Path) -> ServeProcess:
    return ServeProcess("--engine-in-process", "--max-model-len", "512", "--num-kv-blocks", "128", "--no-access-log",
                        "--data-dir", str(data_dir), "--batch-concurrency", "2", "--batch-lease-seconds", "1")


def _client(server: ServeProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=API_KEY, max_retries=0, timeout=60)


@pytest.mark.slow  # two server starts, ~40 s; its fast twin: tests/server/test_batch_worker.py
def test_sigkill_mid_batch_then_restart_answers_each_custom_id_once(tmp_path):
    first = _serve(tmp_path)
    try:
        client = _client(first)
        model = client.models.list().data[0].id
        lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": model, "messages": [{"role": "user", "content": f"Count from {i} to {i + 20}."}],
                           "max_tokens": 24, "temperature": 0.0}} for i in range(LINES)]
        data = "".join(json.dumps(x) + "\n" for x in lines).encode()
        f = client.files.create(file=("in.jsonl", io.BytesIO(data)), purpose="batch")
        batch = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 120
        while client.batches.retrieve(batch.id).request_counts.completed < 3:
            assert time.monotonic() < deadline, "the batch made no progress"
            time.sleep(0.05)
    finally:
        first.proc.send_signal(signal.SIGKILL)
        first.proc.wait(10)
    partial = tmp_path / "batches" / batch.id / "output.jsonl"
    before = partial.read_bytes().count(b"\n")
    assert 3 <= before < LINES, before  # killed mid-batch

    second = _serve(tmp_path)
    try:
        client = _client(second)
        deadline = time.monotonic() + 180
        while (done := client.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
            assert time.monotonic() < deadline, f"not resumed: {done.status} {done.request_counts}"
            time.sleep(0.1)
        assert done.status == "completed", done
        assert done.request_counts.model_dump() == {"total": LINES, "completed": LINES, "failed": 0}
        output = [json.loads(x) for x in client.files.content(done.output_file_id).text.splitlines()]
        assert [x["custom_id"] for x in output] == [f"line-{i}" for i in range(LINES)]
        assert all(x["response"]["status_code"] == 200 for x in output)
        appended = [json.loads(x)["custom_id"] for x in partial.read_text().splitlines()]
        assert sorted(appended) == sorted(f"line-{i}" for i in range(LINES))  # none ran twice, none lost
        assert done.error_file_id is None
    finally:
        second.stop()
