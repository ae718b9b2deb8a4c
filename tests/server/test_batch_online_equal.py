"""Issue 27's batch requirement at full size: 200 chat lines on the bundled model through the official `openai`
client (files.create, batches.create / retrieve, files.content), each line's answer equal (greedy) to the same
request sent online. Slow (the bundled model answers 200 lines, then 200 online requests); its fast twin, 4 lines
and rejected bodies: ``test_batches.py::test_batch_output_equals_online_and_rejected_bodies_land_in_the_error_file``.
"""

from __future__ import annotations

import asyncio
import io
import json
import time

import openai
import pytest

from tests.server.conftest import LiveServer
from tokenfab.server.app import ServerConfig, build_app
from tokenfab.server.batch.config import BatchConfig

N_LINES = 200
MAX_TOKENS = 8


def _body(i: int, model: str) -> dict:
    topic = ("rivers", "bridges", "colors", "numbers", "birds")[i % 5]
    return {"model": model, "messages": [{"role": "user", "content": f"Tell me fact number {i} about {topic}."}],
            "max_tokens": MAX_TOKENS, "temperature": 0.0}


@pytest.mark.slow  # ~2-4 min on 2 shared cores
def test_200_line_batch_equals_online(served, tmp_path):
    config = BatchConfig(data_dir=tmp_path / "data", concurrency=8)
    app = build_app(served.engine, ServerConfig(max_waiting=512, drain_timeout=5), config)
    server = LiveServer(app, lifespan="off")  # a second front end over the session's engine
    try:
        bc = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120)
        lines = [{"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                  "body": _body(i, served.model)} for i in range(N_LINES)]
        data = "".join(json.dumps(x) + "\n" for x in lines).encode()
        f = bc.files.create(file=("input.jsonl", io.BytesIO(data)), purpose="batch")
        batch = bc.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions", completion_window="24h")
        deadline = time.monotonic() + 900
        while (done := bc.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
            assert time.monotonic() < deadline, f"batch still {done.status}: {done.request_counts}"
            time.sleep(0.5)
        assert done.status == "completed", done
        assert done.request_counts.model_dump() == {"total": N_LINES, "completed": N_LINES, "failed": 0}
        assert done.error_file_id is None
        output = [json.loads(x) for x in bc.files.content(done.output_file_id).text.splitlines()]
        assert [x["custom_id"] for x in output] == [f"line-{i}" for i in range(N_LINES)]  # input order, each once

        async def online() -> list:
            ac = openai.AsyncOpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0, timeout=600)
            sem = asyncio.Semaphore(8)

            async def one(i: int):
                async with sem:
                    return await ac.chat.completions.create(**_body(i, served.model))

            return await asyncio.gather(*(one(i) for i in range(N_LINES)))

        answers = asyncio.run(online())
        for i, (line, ans) in enumerate(zip(output, answers)):
            assert line["error"] is None and line["response"]["status_code"] == 200, line
            body = line["response"]["body"]
            assert body["choices"][0]["message"]["content"] == ans.choices[0].message.content, i
            assert body["choices"][0]["finish_reason"] == ans.choices[0].finish_reason, i
            assert (body["usage"]["prompt_tokens"], body["usage"]["completion_tokens"]) == (
                ans.usage.prompt_tokens, ans.usage.completion_tokens), i
    finally:
        server.stop()
        app.state.server.close()
        app.state.batches.db.close()
