"""The job worker: an asyncio task in the API server that moves fine-tuning jobs on. It checks a new job's files
(validating_files -> queued, or failed with the bad line in ``error``), then runs queued jobs one at a time per
device, each in a subprocess (``python -m tokenfab.train.job SPEC``) whose JSON progress lines become events and
checkpoints. Cancel kills the subprocess's process group.

Durability: the job state is in the database. A running job holds a lease (``owner``, ``heartbeat_at``) renewed
every poll; a job whose server stopped renewing it for ``lease_seconds`` is marked failed (code
``worker_lost``), by this server after a restart or by any other sharing the database; it is not requeued (a
half-trained job's events and checkpoints would mix with a second run's: create it again). Queued jobs wait in
the database and run after a restart. The subprocess exits when its stdin closes, so it dies with its server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from tokenfab.server.batch.db import Database
from tokenfab.server.batch.files import FileRow, FileStore, sortable_id
from tokenfab.server.finetune.config import FineTuningConfig
from tokenfab.server.finetune.db import FineTuningCheckpointRow, FineTuningJobRow
from tokenfab.server.finetune.jobs import add_event, model_name
from tokenfab.server.finetune.validation import FileProblem, check_training_file, resolve

logger = logging.getLogger("tokenfab.server.finetune")
BASE_LR = {"lora": 1e-4, "full": 1e-5}  # learning_rate_multiplier 1 (tokenfab finetune's defaults)
LOG_TAIL = 2000

#: (adapter name, adapter folder) -> None when it is served now, else a sentence saying why not
OnAdapter = Callable[[str, str], "str | None"]


class JobWorker:
    def __init__(self, db: Database, files: FileStore, config: FineTuningConfig, base_name: str,
                 on_adapter: OnAdapter) -> None:
        self.db, self.files, self.config, self.base_name = db, files, config, base_name
        self.on_adapter = on_adapter
        self.owner = f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        self.device = f"{socket.gethostname()}/{config.device or 'auto'}"
        self.root = files.root
        self.process: asyncio.subprocess.Process | None = None  # the running job's subprocess
        self._wake = asyncio.Event()
        self._offered: set[str] = set()  # adapters of succeeded jobs already handed to on_adapter
        self._task: asyncio.Task | None = None

    @property
    def started(self) -> bool:
        return self._task is not None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop())

    def wake(self) -> None:
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        self._kill()

    def _kill(self) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGKILL)

    # -- the loop -------------------------------------------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            try:
                await self._serve_finished()
                await self._fail_lost()
                await self._validate_next()
                job = await self.db.run(self._claim)
                if job is not None:
                    await self._run(job)
                    continue
            except asyncio.CancelledError:
                raise
            except Exception:  # a database hiccup must not end the worker
                logger.exception("fine-tuning worker step failed")
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.config.poll_seconds)

    async def _serve_finished(self) -> None:
        """Serve the adapters of succeeded jobs this worker has not offered yet: those finished before this server
        started, or by another API server on the same database. Each is offered once (an adapter unloaded through
        /v1/unload_lora_adapter stays unloaded)."""
        rows = await self.db.run(lambda s: list(s.scalars(select(FineTuningJobRow).where(
            FineTuningJobRow.status == "succeeded", FineTuningJobRow.model == self.base_name,
            FineTuningJobRow.adapter_path.is_not(None)))))
        for row in rows:
            path = self.root / row.adapter_path
            if row.fine_tuned_model not in self._offered and path.is_dir():
                self._offered.add(row.fine_tuned_model)
                self.on_adapter(row.fine_tuned_model, str(path))

    async def _fail_lost(self) -> None:
        stale = time.time() - self.config.lease_seconds

        def fail(s: Session) -> None:
            for row in s.scalars(select(FineTuningJobRow).where(FineTuningJobRow.status == "running",
                                                                FineTuningJobRow.heartbeat_at < stale)):
                if row.owner == self.owner:
                    continue
                row.status, row.finished_at = "failed", int(time.time())
                row.error = {"code": "worker_lost", "param": None, "message": "The server running this job stopped "
                             "before it finished; create the job again"}
                add_event(s, row.id, row.error["message"], level="error")

        await self.db.run(fail)

    async def _validate_next(self) -> None:
        row = await self.db.run(lambda s: s.scalars(select(FineTuningJobRow).where(
            FineTuningJobRow.status == "validating_files").order_by(FineTuningJobRow.created_at).limit(1)).first())
        if row is None:
            return
        try:
            counted = 0
            for param in ("training_file", "validation_file"):
                file_id = getattr(row, param)
                if file_id is None:
                    continue
                frow = await self.db.run(lambda s, f=file_id: s.get(FileRow, f))
                if frow is None:
                    raise FileProblem(f"the file {file_id} was deleted", param)
                checked = await asyncio.to_thread(check_training_file, self.files.path_of(frow), param)
                counted = counted or checked.examples
            error = None
        except FileProblem as e:
            error = {"code": f"invalid_{e.param}", "param": e.param, "message": e.message}

        def record(s: Session) -> None:
            job = s.get(FineTuningJobRow, row.id)
            if job is None or job.status != "validating_files":
                return
            if error is not None:
                job.status, job.finished_at, job.error = "failed", int(time.time()), error
                add_event(s, job.id, f"{error['param']}: {error['message']}", level="error")
                return
            method = dict(job.method)
            hp = resolve(method["supervised"]["hyperparameters"], counted)
            job.method = {**method, "supervised": {"hyperparameters": hp}}
            job.status = "queued"
            add_event(s, job.id, f"Files validated ({counted} training examples), moving job to queued state")

        await self.db.run(record)

    def _claim(self, s: Session) -> FineTuningJobRow | None:
        """The oldest queued job, now running here, unless a job already trains on this device."""
        busy = s.scalars(select(FineTuningJobRow.id).where(FineTuningJobRow.status == "running",
                                                           FineTuningJobRow.device == self.device).limit(1)).first()
        if busy is not None:
            return None
        job = s.scalars(select(FineTuningJobRow).where(FineTuningJobRow.status == "queued")
                        .order_by(FineTuningJobRow.created_at, FineTuningJobRow.id).limit(1)).first()
        if job is None:
            return None
        taken = s.execute(update(FineTuningJobRow).where(  # conditional: two servers never both take it
            FineTuningJobRow.id == job.id, FineTuningJobRow.status == "queued").values(
            status="running", owner=self.owner, heartbeat_at=time.time(), device=self.device))
        if taken.rowcount != 1:
            return None
        add_event(s, job.id, "Fine-tuning job started")
        s.refresh(job)
        return job

    # -- one job --------------------------------------------------------------------------------------------
    def _spec(self, job: FineTuningJobRow, out: Path, paths: dict[str, str | None]) -> dict[str, Any]:
        hp = job.method["supervised"]["hyperparameters"]
        full = hp.get("lora") is False
        return {"model": self.config.base_model, "base_name": self.base_name, "train": paths["training_file"],
                "eval": paths.get("validation_file"), "output_dir": str(out), "full": full,
                "lr": BASE_LR["full" if full else "lora"] * hp["learning_rate_multiplier"],
                "epochs": hp["n_epochs"], "batch_size": hp["batch_size"], "seed": job.seed,
                "lora_r": hp.get("lora_r", 8), "lora_alpha": hp.get("lora_alpha", 8.0), "device": self.config.device}

    async def _paths(self, job: FineTuningJobRow) -> dict[str, str | None]:
        paths: dict[str, str | None] = {}
        for param in ("training_file", "validation_file"):
            file_id = getattr(job, param)
            frow = None if file_id is None else await self.db.run(lambda s, f=file_id: s.get(FileRow, f))
            paths[param] = str(self.files.path_of(frow)) if frow is not None else None
        return paths

    async def _run(self, job: FineTuningJobRow) -> None:
        out = self.root / "fine_tuning" / job.id
        out.mkdir(parents=True, exist_ok=True)
        spec = self._spec(job, out, await self._paths(job))
        (out / "spec.json").write_text(json.dumps(spec, indent=1))
        log_path = out / "worker.log"
        with open(log_path, "ab") as log:
            self.process = await asyncio.create_subprocess_exec(
                self.config.python, "-m", "tokenfab.train.job", str(out / "spec.json"), stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=log, start_new_session=True,
                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        proc = self.process
        await self.db.run(lambda s: setattr(s.get(FineTuningJobRow, job.id), "pid", proc.pid))
        outcome: dict[str, Any] = {}
        reader = asyncio.create_task(self._read(job, proc, outcome))
        try:
            while not reader.done():
                await asyncio.wait({reader}, timeout=self.config.poll_seconds)
                if await self.db.run(lambda s: self._heartbeat(s, job.id)) != "running":
                    self._kill()  # cancelled (or failed by someone else): stop training at once
                await self._fail_lost()  # the rest of the worker's rounds goes on while a job trains
                await self._validate_next()
            await reader
            await proc.wait()
        finally:
            self._kill()
            self.process = None
        await self._finish(job, proc.returncode, outcome, log_path)

    def _heartbeat(self, s: Session, job_id: str) -> str | None:
        """Renew the lease; the job's status (None when it is gone or no longer ours)."""
        row = s.get(FineTuningJobRow, job_id)
        if row is None or row.owner != self.owner:
            return None
        if row.status == "running":
            row.heartbeat_at = time.time()
        return row.status

    async def _read(self, job: FineTuningJobRow, proc: asyncio.subprocess.Process, outcome: dict) -> None:
        assert proc.stdout is not None
        async for raw in proc.stdout:
            try:
                msg = json.loads(raw)
            except ValueError:
                continue  # a library's stray print
            if not isinstance(msg, dict) or "event" not in msg:
                continue
            if msg["event"] in ("succeeded", "failed"):
                outcome.update(msg)
            else:
                await self.db.run(lambda s, m=msg: self._progress(s, job, m))

    def _progress(self, s: Session, job: FineTuningJobRow, msg: dict[str, Any]) -> None:
        row = s.get(FineTuningJobRow, job.id)
        if row is None or row.status != "running":
            return
        if msg["event"] == "started":
            add_event(s, job.id, f"Training: {msg['examples']} examples, {msg['total_steps']} steps")
        elif msg["event"] == "step":
            add_event(s, job.id, f"Step {msg['step']}/{msg['total_steps']}: training loss={msg['train_loss']:.4f}",
                      data={"step": msg["step"], "total_steps": msg["total_steps"], "train_loss": msg["train_loss"]},
                      kind="metrics")
        elif msg["event"] == "checkpoint":
            metrics = {k: v for k, v in msg["metrics"].items() if v is not None}
            if "valid_loss" in metrics:
                add_event(s, job.id, f"Step {msg['step']}: validation loss={metrics['valid_loss']:.4f}",
                          data={"step": msg["step"], "valid_loss": metrics["valid_loss"]}, kind="metrics")
            name = f"{model_name(self.base_name, job.suffix, job.id)}:ckpt-step-{msg['step']}"
            path = os.path.relpath(msg["path"], self.root) if msg.get("path") else ""
            s.add(FineTuningCheckpointRow(id=sortable_id("ftckpt-"), job_id=job.id, step_number=msg["step"],
                                          created_at=int(time.time()), fine_tuned_model_checkpoint=name,
                                          metrics=metrics, path=path))

    async def _finish(self, job: FineTuningJobRow, rc: int | None, outcome: dict, log_path: Path) -> None:
        served: str | None = None
        name = model_name(self.base_name, job.suffix, job.id)
        if outcome.get("event") == "succeeded" and not outcome.get("full") and \
                await self.db.run(lambda s: self._heartbeat(s, job.id)) == "running":  # not cancelled meanwhile
            self._offered.add(name)
            served = self.on_adapter(name, outcome["path"])  # on the event loop, where the registry lives

        def record(s: Session) -> None:
            row = s.get(FineTuningJobRow, job.id)
            if row is None or row.status != "running" or row.owner != self.owner:
                return  # cancelled (or failed as lost) meanwhile: it stays so
            row.finished_at, row.pid = int(time.time()), None
            if outcome.get("event") == "succeeded":
                row.status, row.fine_tuned_model = "succeeded", name
                row.trained_tokens = int(outcome.get("trained_tokens") or 0)
                path = os.path.relpath(outcome["path"], self.root)
                if outcome.get("full"):
                    add_event(s, job.id, f"Full fine-tuning finished: the model is at {outcome['path']}; serve it "
                              f"with `tokenfab serve {outcome['path']}` (a full model is not served as an adapter)")
                else:
                    row.adapter_path = path
                    if served is None:
                        add_event(s, job.id, f"The adapter is served as {name}")
                    else:
                        add_event(s, job.id, served, level="warn")
                add_event(s, job.id, "The job has successfully completed")
                return
            tail = ""
            with contextlib.suppress(OSError):
                tail = log_path.read_bytes()[-LOG_TAIL:].decode("utf-8", "replace").strip()
            message = outcome.get("message") or (f"The training process exited with status {rc}"
                                                 + (f": {tail.splitlines()[-1]}" if tail else ""))
            code = outcome.get("code") or "training_failed"
            param = "training_file" if code == "invalid_training_file" else None
            row.status, row.error = "failed", {"code": code, "param": param, "message": message}
            add_event(s, job.id, message, level="error")

        await self.db.run(record)
