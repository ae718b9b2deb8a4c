"""The batch worker inside the API server: claims an unfinished batch (a lease in the database, so several API
servers sharing one database split the work and a dead server's batches are taken over), runs its pending lines
through ``LineRunner`` with bounded concurrency at the lowest priority, appends each result as it finishes, and
finalizes (output and error files, status). On a restart the batch resumes from its result files: every
custom_id is answered exactly once."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import time
import uuid
from typing import Any

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session

from tokenfab.server.batch.batches import ACTIVE
from tokenfab.server.batch.config import BatchConfig
from tokenfab.server.batch.db import BatchLineRow, BatchRow, Database
from tokenfab.server.batch.dispatch import LineRunner
from tokenfab.server.batch.files import FileStore
from tokenfab.server.batch.results import ResultFiles, result_line, usage_of
from tokenfab.server.batch.validation import read_lines
from tokenfab.server.errors import APIError

logger = logging.getLogger("tokenfab.server.batch")
RETRY_SECONDS = 0.5  # a full engine queue (429): the line waits and tries again
POLL_SECONDS = 1.0
ENGINE_RETRY_SECONDS = 5.0  # the engine answered 503: the batch is released and looked at again after this


class _EngineUnavailable(Exception):
    """The engine answered 503: stop the batch, its pending lines stay pending."""


class BatchWorker:
    def __init__(self, db: Database, files: FileStore, runner: LineRunner, config: BatchConfig) -> None:
        self.db, self.files, self.runner, self.config = db, files, runner, config
        self.owner = uuid.uuid4().hex
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None
        self._stop_reason: str | None = None  # of the running batch: cancel, expired, lost, engine, failed
        self._current: str | None = None

    @property
    def started(self) -> bool:
        return self._task is not None

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="tokenfab-batch-worker")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def wake(self, cancelled: str | None = None) -> None:
        """A batch was created (or ``cancelled`` one was): look now, not at the next poll."""
        if cancelled is not None and cancelled == self._current:
            self._stop_reason = "cancel"
        self._wake.set()

    # ---- the loop ----
    async def _loop(self) -> None:
        while True:
            self._wake.clear()
            batch_id = await self.db.run(self._claim)
            if batch_id is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), POLL_SECONDS)
                continue
            try:
                await self._run_batch(batch_id)
            except asyncio.CancelledError:
                await asyncio.shield(self.db.run(functools.partial(self._release, batch_id)))
                raise
            except Exception:
                logger.exception("batch %s: the worker failed; released for a retry", batch_id)
                await self.db.run(functools.partial(self._release, batch_id))
                await asyncio.sleep(POLL_SECONDS)

    def _claim(self, s: Session) -> str | None:
        now = time.time()
        free = or_(BatchRow.owner.is_(None), BatchRow.owner == self.owner,
                   BatchRow.heartbeat_at < now - self.config.lease_seconds)
        for batch_id in s.scalars(select(BatchRow.id).where(BatchRow.status.in_(ACTIVE), free)
                                  .order_by(BatchRow.created_at).limit(8)):
            taken = s.execute(update(BatchRow).where(BatchRow.id == batch_id, BatchRow.status.in_(ACTIVE), free)
                              .values(owner=self.owner, heartbeat_at=now))
            if taken.rowcount == 1:  # type: ignore[attr-defined]
                return batch_id
        return None

    def _release(self, batch_id: str, s: Session) -> None:
        s.execute(update(BatchRow).where(BatchRow.id == batch_id, BatchRow.owner == self.owner)
                  .values(owner=None, heartbeat_at=None))

    # ---- one batch ----
    async def _run_batch(self, batch_id: str) -> None:
        self._current, self._stop_reason = batch_id, None
        results = ResultFiles(self.files.root, batch_id)
        done, usage = await asyncio.to_thread(results.reconcile)
        row = await self.db.run(lambda s: self._resume(s, batch_id, done, usage))
        try:
            if row.status == "in_progress":
                await self._execute(row, results)
        finally:
            await asyncio.to_thread(results.close)
            self._current = None
        reason = self._stop_reason
        if reason in ("lost", "engine", "failed"):
            if reason == "engine":
                await self.db.run(functools.partial(self._release, batch_id))
                await asyncio.sleep(ENGINE_RETRY_SECONDS)
            return
        final = {"cancel": "cancelled", "expired": "expired"}.get(reason or "", None)
        await self._finalize(batch_id, results, final)

    def _resume(self, s: Session, batch_id: str, done: dict[str, bool], usage: dict[str, int]) -> BatchRow:
        """The database brought in line with the result files (the truth after a crash); validating -> in_progress."""
        ids = list(done)
        for failed in (False, True):
            chunk_ids = [c for c in ids if done[c] is failed]
            for i in range(0, len(chunk_ids), 500):
                s.execute(update(BatchLineRow).where(BatchLineRow.batch_id == batch_id,
                                                     BatchLineRow.custom_id.in_(chunk_ids[i:i + 500]))
                          .values(done=True, failed=failed))
        row = s.get(BatchRow, batch_id)
        assert row is not None
        row.failed = sum(done.values())
        row.completed = len(done) - row.failed
        for name, value in usage.items():
            setattr(row, name, value)
        if row.status == "validating":
            row.status, row.in_progress_at = "in_progress", int(time.time())
        if row.status == "in_progress" and time.time() > row.expires_at:
            self._stop_reason = "expired"
            row.status = "finalizing"
        if row.status == "cancelling":
            self._stop_reason = "cancel"
        return row

    async def _execute(self, row: BatchRow, results: ResultFiles) -> None:
        pending = set(await self.db.run(lambda s: list(s.scalars(select(BatchLineRow.line).where(
            BatchLineRow.batch_id == row.id, BatchLineRow.done.is_(False))))))
        try:
            source = await self.files.get(row.input_file_id)
            todo = (item for item in read_lines(self.files.path_of(source)) if item[0] in pending)
            first = next(todo, None)  # the file opens here: a missing one fails the batch, not the worker
        except (APIError, OSError) as e:
            self._stop_reason = "failed"
            message = f"the input file cannot be read: {e}"
            await self.db.run(lambda s: _fail(s, row.id, message))
            return
        todo = itertools.chain([first] if first is not None else [], todo)
        beat = asyncio.create_task(self._heartbeat(row))
        tasks: set[asyncio.Task] = set()
        try:
            while not self._stop_reason:
                while len(tasks) < self.config.concurrency and (item := next(todo, None)) is not None:
                    number, raw = item
                    task = asyncio.create_task(self._run_line(row.id, number, json.loads(raw), results))
                    tasks.add(task)
                if not tasks:
                    break
                finished, _ = await asyncio.wait(tasks, timeout=POLL_SECONDS, return_when=asyncio.FIRST_COMPLETED)
                tasks -= finished
                for task in finished:
                    if task.exception() is not None:  # a line that could not be recorded: retry the batch later
                        raise task.exception()  # type: ignore[misc]
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            beat.cancel()

    async def _run_line(self, batch_id: str, number: int, line: dict[str, Any], results: ResultFiles) -> None:
        try:
            while True:
                status, body = await self.runner.run(line["url"], line["body"])
                if status == 429:
                    await asyncio.sleep(RETRY_SECONDS)
                    continue
                if status == 503:
                    raise _EngineUnavailable(body)
                break
        except _EngineUnavailable:
            self._stop_reason = self._stop_reason or "engine"
            return
        failed = status >= 400
        results.append(result_line(line["custom_id"], status, body), failed)
        usage = {} if failed else usage_of(body)
        await self.db.run(lambda s: _mark_done(s, batch_id, number, failed, usage))

    async def _heartbeat(self, row: BatchRow) -> None:
        while not self._stop_reason:
            await asyncio.sleep(min(self.config.lease_seconds / 3, POLL_SECONDS))
            self._stop_reason = self._stop_reason or await self.db.run(lambda s: self._renew(s, row.id))

    def _renew(self, s: Session, batch_id: str) -> str | None:
        now = time.time()
        held = s.execute(update(BatchRow).where(BatchRow.id == batch_id, BatchRow.owner == self.owner)
                         .values(heartbeat_at=now))
        if held.rowcount != 1:  # type: ignore[attr-defined]
            return "lost"
        row = s.get(BatchRow, batch_id)
        assert row is not None
        if row.status == "cancelling":
            return "cancel"
        return "expired" if now > row.expires_at else None

    async def _finalize(self, batch_id: str, results: ResultFiles, final: str | None) -> None:
        def begin(s: Session) -> dict[str, int]:
            row = s.get(BatchRow, batch_id)
            assert row is not None
            if final is None and row.status == "in_progress":
                row.status, row.finalizing_at = "finalizing", int(time.time())
            return {c: n for c, n in s.execute(select(BatchLineRow.custom_id, BatchLineRow.line)
                                               .where(BatchLineRow.batch_id == batch_id))}

        order = await self.db.run(begin)
        output = await asyncio.to_thread(results.publish, False, order, self.files, batch_id)
        errors = await asyncio.to_thread(results.publish, True, order, self.files, batch_id)

        def end(s: Session) -> None:
            row = s.get(BatchRow, batch_id)
            assert row is not None
            status = final or "completed"
            for file_row in (output, errors):
                if file_row is not None:
                    s.add(file_row)
            row.output_file_id = output.id if output else None
            row.error_file_id = errors.id if errors else None
            row.status = status
            setattr(row, f"{status}_at", int(time.time()))
            row.owner = row.heartbeat_at = None

        await self.db.run(end)
        logger.info("batch %s %s", batch_id, final or "completed")


def _fail(s: Session, batch_id: str, message: str) -> None:
    row = s.get(BatchRow, batch_id)
    assert row is not None
    row.status, row.failed_at, row.owner, row.heartbeat_at = "failed", int(time.time()), None, None
    row.errors = [{"code": "input_file_unreadable", "message": message, "param": "input_file_id", "line": None}]


def _mark_done(s: Session, batch_id: str, number: int, failed: bool, usage: dict[str, int]) -> None:
    s.execute(update(BatchLineRow).where(BatchLineRow.batch_id == batch_id, BatchLineRow.line == number)
              .values(done=True, failed=failed))
    counter = BatchRow.failed if failed else BatchRow.completed
    sums = {getattr(BatchRow, k): getattr(BatchRow, k) + v for k, v in usage.items() if v}
    s.execute(update(BatchRow).where(BatchRow.id == batch_id).values({counter: counter + 1, **sums}))

