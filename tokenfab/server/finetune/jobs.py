"""The job store: create (request checked, files looked up), retrieve, list, cancel, events and checkpoints, each
in OpenAI's shape (openai-python ``types/fine_tuning/``). Statuses: validating_files -> queued -> running ->
succeeded, or failed, or cancelled. The worker (``worker.py``) moves a job on; this module only records."""

from __future__ import annotations

import time
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from tokenfab.server.batch.batches import check_metadata
from tokenfab.server.batch.db import Database
from tokenfab.server.batch.files import FileStore, after_cursor, sortable_id
from tokenfab.server.errors import APIError
from tokenfab.server.finetune.db import FineTuningCheckpointRow, FineTuningEventRow, FineTuningJobRow
from tokenfab.server.finetune.validation import check_method, check_suffix

FINISHED = ("succeeded", "failed", "cancelled")


def job_object(row: FineTuningJobRow) -> dict[str, Any]:
    hp = row.method.get("supervised", {}).get("hyperparameters", {})
    shown = {k: hp.get(k, "auto") for k in ("n_epochs", "batch_size", "learning_rate_multiplier")}
    return {"id": row.id, "object": "fine_tuning.job", "created_at": row.created_at, "error": row.error,
            "fine_tuned_model": row.fine_tuned_model, "finished_at": row.finished_at, "hyperparameters": shown,
            "model": row.model, "organization_id": "org-tokenfab", "result_files": row.result_files or [],
            "seed": row.seed, "status": row.status, "trained_tokens": row.trained_tokens,
            "training_file": row.training_file, "validation_file": row.validation_file, "estimated_finish": None,
            "integrations": None, "metadata": row.metadata_, "method": row.method,
            "user_provided_suffix": row.suffix}


def event_object(row: FineTuningEventRow) -> dict[str, Any]:
    return {"id": row.id, "object": "fine_tuning.job.event", "created_at": row.created_at, "level": row.level,
            "message": row.message, "data": row.data, "type": row.type}


def checkpoint_object(row: FineTuningCheckpointRow) -> dict[str, Any]:
    return {"id": row.id, "object": "fine_tuning.job.checkpoint", "created_at": row.created_at,
            "fine_tuned_model_checkpoint": row.fine_tuned_model_checkpoint, "fine_tuning_job_id": row.job_id,
            "metrics": row.metrics, "step_number": row.step_number}


def model_name(base: str, suffix: str | None, job_id: str) -> str:
    return f"ft:{base}:{suffix or ''}:{job_id}"


def add_event(s: Session, job_id: str, message: str, level: str = "info", data: dict | None = None,
              kind: str = "message") -> None:
    """Append an event to ``job_id`` inside the caller's transaction."""
    seq = s.scalar(select(func.count()).where(FineTuningEventRow.job_id == job_id)) or 0
    s.add(FineTuningEventRow(id=sortable_id("ftevent-"), job_id=job_id, seq=seq + 1, created_at=int(time.time()),
                             level=level, type=kind, message=message, data=data))


class JobStore:
    def __init__(self, db: Database, files: FileStore, base_model: str) -> None:
        self.db, self.files, self.base_model = db, files, base_model

    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise APIError(400, "model is required (a string)", param="model")
        if model != self.base_model:
            raise APIError(400, f"The model '{model}' does not exist or cannot "
                           f"be fine-tuned here; this server fine-tunes '{self.base_model}'", param="model",
                           code="model_not_found")
        method = check_method(body.get("method"), body.get("hyperparameters"))
        suffix = check_suffix(body.get("suffix"))
        seed = body.get("seed")
        if seed is not None and (type(seed) is not int or not 0 <= seed <= 2**31 - 1):
            raise APIError(400, "seed must be an integer in [0, 2147483647]", param="seed")
        metadata = check_metadata(body.get("metadata"))
        for param in ("training_file", "validation_file"):
            file_id = body.get(param)
            if file_id is None and param == "validation_file":
                continue
            if not isinstance(file_id, str) or not file_id:
                raise APIError(400, f"{param} must be a file id (a string)", param=param)
            row = await self.files.get(file_id, param)
            if row.purpose != "fine-tune":
                raise APIError(400, f"File {file_id} has purpose '{row.purpose}'; upload {param} with purpose "
                               "'fine-tune'", param=param, code="invalid_file_purpose")
        now = int(time.time())
        job = FineTuningJobRow(id=sortable_id("ftjob-"), status="validating_files", model=model,
                               training_file=body["training_file"], validation_file=body.get("validation_file"),
                               suffix=suffix, seed=seed if seed is not None else now % 2**31, method=method,
                               metadata_=metadata, created_at=now)

        def store(s: Session) -> None:
            s.add(job)
            s.flush()
            add_event(s, job.id, f"Created fine-tuning job: {job.id}")
            add_event(s, job.id, "Validating training file: " + job.training_file
                      + (f" and validation file: {job.validation_file}" if job.validation_file else ""))

        await self.db.run(store)
        return job_object(job)

    async def get_row(self, job_id: str) -> FineTuningJobRow:
        row = await self.db.run(lambda s: s.get(FineTuningJobRow, job_id))
        if row is None:
            raise APIError(404, f"No such fine-tuning job: {job_id}", param="fine_tuning_job_id",
                           code="fine_tuning_job_not_found")
        return row

    async def retrieve(self, job_id: str) -> dict[str, Any]:
        return job_object(await self.get_row(job_id))

    async def list_jobs(self, limit: int, after: str | None, metadata: dict[str, str] | None) -> dict[str, Any]:
        def query(s: Session) -> tuple[list[FineTuningJobRow], bool]:
            q = select(FineTuningJobRow)
            if after is not None:
                cursor = s.get(FineTuningJobRow, after)
                if cursor is None:
                    raise APIError(400, f"after: no such fine-tuning job {after}", param="after")
                q = q.where(after_cursor(FineTuningJobRow, cursor.created_at, cursor.id, desc=True))
            q = q.order_by(FineTuningJobRow.created_at.desc(), FineTuningJobRow.id.desc())
            if metadata:  # filtered in Python: JSON queries are not portable SQL
                rows = [r for r in s.scalars(q) if all((r.metadata_ or {}).get(k) == v for k, v in metadata.items())]
                return rows[:limit], len(rows) > limit
            rows = list(s.scalars(q.limit(limit + 1)))
            return rows[:limit], len(rows) > limit

        rows, more = await self.db.run(query)
        return {"object": "list", "data": [job_object(r) for r in rows], "has_more": more}

    async def cancel(self, job_id: str) -> dict[str, Any]:
        def mark(s: Session) -> FineTuningJobRow | None:
            row = s.get(FineTuningJobRow, job_id)
            if row is not None and row.status not in FINISHED:
                row.status, row.finished_at = "cancelled", int(time.time())
                add_event(s, job_id, "Fine-tuning job cancelled")
            return row

        row = await self.db.run(mark)
        if row is None:
            raise APIError(404, f"No such fine-tuning job: {job_id}", param="fine_tuning_job_id",
                           code="fine_tuning_job_not_found")
        if row.status != "cancelled":
            raise APIError(409, f"Cannot cancel a job with status '{row.status}'", param="fine_tuning_job_id",
                           code="fine_tuning_job_not_cancellable")
        return job_object(row)

    async def events(self, job_id: str, limit: int, after: str | None) -> dict[str, Any]:
        """Newest first, as OpenAI lists them; ``after`` an event id."""
        await self.get_row(job_id)

        query = _newest_first_page(FineTuningEventRow, FineTuningEventRow.seq, job_id, limit, after, "event")
        rows, more = await self.db.run(query)
        return {"object": "list", "data": [event_object(r) for r in rows], "has_more": more}

    async def checkpoints(self, job_id: str, limit: int, after: str | None) -> dict[str, Any]:
        """Newest (largest step) first; ``after`` a checkpoint id."""
        await self.get_row(job_id)

        query = _newest_first_page(FineTuningCheckpointRow, FineTuningCheckpointRow.step_number, job_id, limit, after,
                                   "checkpoint")
        rows, more = await self.db.run(query)
        data = [checkpoint_object(r) for r in rows]
        return {"object": "list", "data": data, "has_more": more, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None}


def _newest_first_page(row_type: Any, order: Any, job_id: str, limit: int, after: str | None, what: str):
    """A query (for ``db.run``) of one job's rows of ``row_type``, largest ``order`` first, ``limit`` of them
    after the row ``after`` (an id of this job, else a 400): (rows, whether more follow)."""

    def query(s: Session) -> tuple[list[Any], bool]:
        q = select(row_type).where(row_type.job_id == job_id)
        if after is not None:
            cursor = s.get(row_type, after)
            if cursor is None or cursor.job_id != job_id:
                raise APIError(400, f"after: no such {what} {after} in this job", param="after")
            q = q.where(order < getattr(cursor, order.key))
        rows = list(s.scalars(q.order_by(order.desc()).limit(limit + 1)))
        return rows[:limit], len(rows) > limit

    return query
