"""/v1/fine_tuning/jobs (tokenfab/server/finetune/) through the official `openai` client, on a tiny random Llama
with the bundled tokenizer: a job trains in its own process (``python -m tokenfab.train.job``), reports losses as
events and checkpoints, and its adapter is served at once under ``ft:base:<suffix>:<job id>`` with the greedy
output of PEFT's merged model; cancel kills the training process; hostile requests are 4xx with OpenAI's error
body, a bad training line fails the job with the line's number in ``error``; a job whose server died is failed
when the lease runs out."""

from __future__ import annotations

import io
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.server.conftest import LiveServer
from tests.server.inprocess import assert_error
from tests.tiny_models import tiny_llama_with_bundled_tokenizer
from tokenfab.engine.core.async_engine import AsyncEngine
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.server.app import ServerConfig, build_app
from tokenfab.server.batch.config import BatchConfig
from tokenfab.server.finetune.config import FineTuningConfig
from tokenfab.server.finetune.db import FineTuningJobRow

pytest.importorskip("peft")

WORDS = ("apple", "river", "stone", "cloud", "tiger", "garden")
TRAIN = [{"messages": [{"role": "user", "content": f"Say {w}"}, {"role": "assistant", "content": f"ANSWER: {w}"}]}
         for w in WORDS]
VALID = [{"messages": [{"role": "user", "content": "Say window"}, {"role": "assistant", "content": "ANSWER: window"}]}]
CHAT = [{"role": "user", "content": "Say apple"}]
N_NEW = 6


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> tuple[str, Any, Any]:
    """(folder, transformers model, tokenizer): a tiny random Llama with the bundled model's tokenizer."""
    model, tokenizer = tiny_llama_with_bundled_tokenizer()
    folder = tmp_path_factory.mktemp("ft-base")
    model.save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return str(folder), model, tokenizer


def _serve(folder: str, data_dir, enable_lora: bool) -> tuple[LiveServer, Any]:
    engine = LLMEngine(model=folder, device="cpu", dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8,
                       num_kv_blocks=64, block_size=4, served_model_name="base")
    app = build_app(AsyncEngine(engine), ServerConfig(enable_lora=enable_lora, max_lora_rank=8, drain_timeout=5),
                    BatchConfig(data_dir=data_dir),
                    FineTuningConfig(base_model=folder, device="cpu", poll_seconds=0.2, lease_seconds=2.0))
    return LiveServer(app), app


@pytest.fixture(scope="module")
def live(base, tmp_path_factory) -> Iterator[tuple[LiveServer, Any, Any]]:
    server, app = _serve(base[0], tmp_path_factory.mktemp("ft-data"), enable_lora=True)
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
    yield server, app, client
    server.stop()


def _upload(client: openai.OpenAI, records: list[Any], purpose: str = "fine-tune") -> Any:
    data = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records).encode()
    return client.files.create(file=("train.jsonl", io.BytesIO(data)), purpose=purpose)


def _wait(client: openai.OpenAI, job_id: str, until: tuple[str, ...], timeout: float = 240) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        job = client.fine_tuning.jobs.retrieve(job_id)
        if job.status in until:
            return job
        assert time.monotonic() < deadline, f"job {job_id} still {job.status}"
        time.sleep(0.2)


def test_job_trains_reports_losses_and_serves_its_adapter(live, base):
    from tests.lora.adapters import merged_greedy

    server, app, client = live
    folder, hf_base, tokenizer = base
    train, valid = _upload(client, TRAIN), _upload(client, VALID)
    job = client.fine_tuning.jobs.create(
        model="base", training_file=train.id, validation_file=valid.id, suffix="demo", seed=3,
        metadata={"team": "qa"},
        method={"type": "supervised", "supervised": {"hyperparameters": {
            "n_epochs": 2, "batch_size": 3, "learning_rate_multiplier": 100}}})
    assert job.status == "validating_files" and job.object == "fine_tuning.job" and job.id.startswith("ftjob-")
    done = _wait(client, job.id, ("succeeded", "failed", "cancelled"))
    assert done.status == "succeeded", done.error
    assert done.fine_tuned_model == f"ft:base:demo:{job.id}"
    assert done.hyperparameters.n_epochs == 2 and done.hyperparameters.batch_size == 3
    assert done.trained_tokens and done.trained_tokens > 0 and done.finished_at >= done.created_at

    events = client.fine_tuning.jobs.list_events(job.id, limit=100).data
    train_losses = [e.data["train_loss"] for e in events if e.type == "metrics" and "train_loss" in (e.data or {})]
    valid_losses = [e.data["valid_loss"] for e in events if e.type == "metrics" and "valid_loss" in (e.data or {})]
    assert len(train_losses) == 4 and all(x > 0 for x in train_losses)  # 6 examples / 3 a step x 2 epochs
    assert len(valid_losses) == 2
    assert events[0].message == "The job has successfully completed"  # newest first
    page = client.fine_tuning.jobs.list_events(job.id, limit=2)
    assert len(page.data) == 2 and page.has_more
    assert client.fine_tuning.jobs.list_events(job.id, after=page.data[-1].id, limit=1).data[0].id == events[2].id

    ckpts = client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert [c.step_number for c in ckpts] == [4, 2]
    assert ckpts[0].fine_tuned_model_checkpoint == f"ft:base:demo:{job.id}:ckpt-step-4"
    assert ckpts[0].metrics.train_loss == pytest.approx(train_losses[0]) and ckpts[0].metrics.valid_loss > 0

    listed = client.fine_tuning.jobs.list(limit=10).data
    assert job.id in [j.id for j in listed]

    cards = {m.id: m for m in client.models.list().data}
    assert cards[done.fine_tuned_model].parent == "base"
    adapter = app.state.batches.config.data_dir / "fine_tuning" / job.id / "adapter"
    assert (adapter / "adapter_model.safetensors").is_file()

    chat_text = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=False)
    chat_ids = tokenizer.encode(chat_text, add_special_tokens=False)
    tuned_ref, base_ref = (merged_greedy(hf_base, a, [chat_ids], N_NEW)[0] for a in (adapter, None))
    assert tuned_ref != base_ref  # the training changed the model
    out = client.chat.completions.create(model=done.fine_tuned_model, messages=CHAT, max_tokens=N_NEW,
                                         temperature=0.0, extra_body={"ignore_eos": True})
    assert out.choices[0].message.content == tokenizer.decode(tuned_ref, skip_special_tokens=True)
    assert out.model == done.fine_tuned_model


def test_cancel_kills_the_training_process(live):
    server, app, client = live
    train = _upload(client, TRAIN * 4)
    job = client.fine_tuning.jobs.create(model="base", training_file=train.id,
                                         hyperparameters={"n_epochs": 50, "batch_size": 1})
    worker = app.state.fine_tuning.worker
    deadline = time.monotonic() + 120
    while not any(e.type == "metrics" for e in client.fine_tuning.jobs.list_events(job.id, limit=5).data):
        assert time.monotonic() < deadline, "the job never reported a step"
        time.sleep(0.2)
    pid = worker.process.pid
    os.kill(pid, 0)  # alive
    bad = client.fine_tuning.jobs.create(model="base", training_file=_upload(client, ["{"]).id)
    assert _wait(client, bad.id, ("failed",), timeout=30).error.code == "invalid_training_file"  # checked meanwhile
    assert client.fine_tuning.jobs.retrieve(job.id).status == "running"
    cancelled = client.fine_tuning.jobs.cancel(job.id)
    assert cancelled.status == "cancelled"
    deadline = time.monotonic() + 30
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            break
        assert time.monotonic() < deadline, "the training process outlived its cancel"
        time.sleep(0.1)
    assert client.fine_tuning.jobs.retrieve(job.id).status == "cancelled"
    assert client.fine_tuning.jobs.cancel(job.id).status == "cancelled"  # again: the same answer


def test_bad_training_lines_fail_the_job_with_the_line_number(live):
    server, _, client = live
    for lines, fragment in [(["{not json"], "line 1"),
                            ([TRAIN[0], {"messages": [{"role": "user", "content": "hi"}]}], "line 2"),
                            ([TRAIN[0], TRAIN[1], {"messages": [{"role": "wizard", "content": "x"}]}], "line 3"),
                            ([TRAIN[0], [1, 2]], "line 2"),
                            ([{"prompt": 3}], "line 1")]:
        f = _upload(client, lines)
        job = client.fine_tuning.jobs.create(model="base", training_file=f.id)
        failed = _wait(client, job.id, ("failed", "succeeded", "queued", "running"), timeout=30)
        assert failed.status == "failed" and failed.error.code == "invalid_training_file", failed
        assert fragment in failed.error.message and failed.error.param == "training_file"
    valid_bad = client.fine_tuning.jobs.create(model="base", training_file=_upload(client, TRAIN).id,
                                               validation_file=_upload(client, [TRAIN[0], "[]"]).id)
    failed = _wait(client, valid_bad.id, ("failed", "succeeded", "queued", "running"), timeout=30)
    assert failed.error.code == "invalid_validation_file" and "line 2" in failed.error.message, failed
    with httpx.Client(base_url=server.url) as http:  # a finished job cannot be cancelled
        assert_error(http.post(f"/v1/fine_tuning/jobs/{job.id}/cancel"), 409, "fine_tuning_job_id")


@pytest.mark.parametrize("body,status,param", [
    ({"model": "nope", "training_file": "FILE"}, 400, "model"),
    ({"model": "base", "training_file": "file-missing"}, 404, "training_file"),
    ({"model": "base", "training_file": "BATCHFILE"}, 400, "training_file"),
    ({"model": "base", "training_file": "FILE", "validation_file": "file-missing"}, 404, "validation_file"),
    ({"model": "base", "training_file": "FILE", "hyperparameters": {"n_epochs": 0}}, 400, "hyperparameters.n_epochs"),
    ({"model": "base", "training_file": "FILE", "hyperparameters": {"batch_size": "big"}}, 400,
     "hyperparameters.batch_size"),
    ({"model": "base", "training_file": "FILE", "method": {"type": "supervised", "supervised": {"hyperparameters": {
        "learning_rate_multiplier": -1}}}}, 400, "method.supervised.hyperparameters.learning_rate_multiplier"),
    ({"model": "base", "training_file": "FILE", "method": {"type": "supervised", "supervised": {"hyperparameters": {
        "n_epochs": True}}}}, 400, "method.supervised.hyperparameters.n_epochs"),
    ({"model": "base", "training_file": "FILE", "method": {"type": "dpo"}}, 400, "method.type"),
    ({"model": "base", "training_file": "FILE", "hyperparameters": {"warp": 9}}, 400, "hyperparameters.warp"),
    ({"model": "base", "training_file": "FILE", "method": {"type": "supervised"}, "hyperparameters": {}}, 400,
     "hyperparameters"),
    ({"model": "base", "training_file": "FILE", "suffix": "no spaces allowed"}, 400, "suffix"),
    ({"model": "base", "training_file": "FILE", "seed": -1}, 400, "seed"),
    ({"model": "base", "training_file": "FILE", "seed": "5"}, 400, "seed"),
    ({"model": "base", "training_file": "FILE", "seed": True}, 400, "seed"),
    ({"model": "base", "training_file": "FILE", "metadata": {"k": 1}}, 400, "metadata"),
    ({"model": "base", "training_file": "FILE", "surprise": 1}, 400, "surprise"),
    ({"model": 7, "training_file": "FILE"}, 400, "model"),
    ({"training_file": "FILE"}, 400, "model"),
    ("[1]", 400, None),
    ("{broken", 400, None),
])
def test_hostile_create_is_a_4xx(live, body, status, param):
    server, _, client = live
    ids = {"FILE": _upload(client, TRAIN).id, "BATCHFILE": _upload(client, ["{}"], purpose="batch").id}
    with httpx.Client(base_url=server.url, timeout=30) as http:
        if isinstance(body, str):
            r = http.post("/v1/fine_tuning/jobs", content=body, headers={"content-type": "application/json"})
        else:
            body = {k: ids.get(v, v) if isinstance(v, str) else v for k, v in body.items()}
            r = http.post("/v1/fine_tuning/jobs", json=body)
        assert_error(r, status, param)


def test_unknown_job_and_bad_cursors(live):
    server, _, client = live
    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.retrieve("ftjob-nope")
    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.cancel("ftjob-nope")
    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.list_events("ftjob-nope")
    with pytest.raises(openai.NotFoundError):
        client.fine_tuning.jobs.checkpoints.list("ftjob-nope")
    with httpx.Client(base_url=server.url) as http:
        assert_error(http.get("/v1/fine_tuning/jobs", params={"after": "ftjob-nope"}), 400, "after")
        assert_error(http.get("/v1/fine_tuning/jobs", params={"limit": 0}), 400)


def test_a_job_whose_server_died_fails_when_its_lease_runs_out(live):
    _, app, client = live
    db = app.state.batches.db
    train = _upload(client, TRAIN)
    job = client.fine_tuning.jobs.create(model="base", training_file=train.id,
                                         hyperparameters={"n_epochs": 50, "batch_size": 1})
    _wait(client, job.id, ("running",), timeout=60)
    client.fine_tuning.jobs.cancel(job.id)  # stop the real one, then play a job left by a dead server
    deadline = time.monotonic() + 30
    while app.state.fine_tuning.worker.process is not None:
        assert time.monotonic() < deadline
        time.sleep(0.1)

    def orphan(s: Any) -> None:
        row = s.get(FineTuningJobRow, job.id)
        row.status, row.owner, row.heartbeat_at, row.finished_at, row.device = "running", "gone", 0.0, None, "x/y"

    db.call(orphan)
    failed = _wait(client, job.id, ("failed",), timeout=30)
    assert failed.error.code == "worker_lost"


def test_without_enable_lora_not_served_then_served_after_a_restart_with_it(base, tmp_path):
    """Without --enable-lora: the job succeeds, an event says the adapter is not served, /v1/models omits it; a
    full fine-tuning job writes a model folder; a server restarted with --enable-lora on the same data dir serves
    the LoRA job's adapter."""
    server, app = _serve(base[0], tmp_path / "data", enable_lora=False)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        train = _upload(client, TRAIN)
        job = client.fine_tuning.jobs.create(model="base", training_file=train.id, suffix="x",
                                             hyperparameters={"n_epochs": 1, "batch_size": 6})
        full = client.fine_tuning.jobs.create(model="base", training_file=train.id, suffix="full", method={
            "type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1, "batch_size": 6, "lora": False}}})
        done = _wait(client, job.id, ("succeeded", "failed"))
        assert done.status == "succeeded", done.error
        messages = [e.message for e in client.fine_tuning.jobs.list_events(job.id, limit=50).data]
        assert any("without --enable-lora" in m for m in messages)
        assert done.fine_tuned_model not in {m.id for m in client.models.list().data}
        full_done = _wait(client, full.id, ("succeeded", "failed"))
        assert full_done.status == "succeeded", full_done.error
        model_dir = tmp_path / "data" / "fine_tuning" / full.id / "model"
        assert (model_dir / "config.json").is_file() and list(model_dir.glob("*.safetensors"))
        messages = [e.message for e in client.fine_tuning.jobs.list_events(full.id, limit=50).data]
        assert any("tokenfab serve" in m for m in messages)
    finally:
        server.stop()
    server, app = _serve(base[0], tmp_path / "data", enable_lora=True)
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)
        deadline = time.monotonic() + 30
        while done.fine_tuned_model not in {m.id for m in client.models.list().data}:
            assert time.monotonic() < deadline, "the succeeded job's adapter is not served after the restart"
            time.sleep(0.1)
        assert full_done.fine_tuned_model not in {m.id for m in client.models.list().data}
        out = client.chat.completions.create(model=done.fine_tuned_model, messages=CHAT, max_tokens=2)
        assert out.model == done.fine_tuned_model
    finally:
        server.stop()


def test_the_training_process_exits_when_its_server_goes(base, tmp_path):
    """stdin closed (its server died) while it trains: the job process exits on its own (status 3)."""
    import subprocess
    import sys

    data = tmp_path / "train.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in TRAIN))
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": base[0], "train": str(data), "output_dir": str(tmp_path / "o"),
                                "epochs": 50, "batch_size": 1, "device": "cpu"}))
    proc = subprocess.Popen([sys.executable, "-m", "tokenfab.train.job", str(spec)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        for line in proc.stdout:
            if json.loads(line)["event"] == "step":
                break
        proc.stdin.close()
        assert proc.wait(timeout=60) == 3
    finally:
        proc.kill()
        proc.wait()


def test_schemathesis_on_the_fine_tuning_routes_never_5xx(tmp_path):
    """Every fine-tuning operation fuzzed from the OpenAPI document (valid and invalid bodies, over a fake
    engine): no 5xx, every error in OpenAI's body."""
    import schemathesis

    from tests.server.fake_engine import FakeEngine
    from tests.server.fuzzing import run_schemathesis

    engine = AsyncEngine(FakeEngine(step_time=0.0, max_model_len=64))
    app = build_app(engine, ServerConfig(drain_timeout=0), BatchConfig(data_dir=tmp_path),
                    FineTuningConfig(base_model=None, device="cpu"))
    engine.start()
    try:
        schema = schemathesis.openapi.from_asgi("/openapi.json", app).include(path_regex="fine_tuning")
        report = run_schemathesis(schema, max_examples=20)
    finally:
        engine.shutdown(0)
        app.state.batches.db.close()
    assert len(report.by_operation) == 6 and report.requests >= 6 * 20
    assert report.server_errors == 0 and not report.failures, report.failures
