"""``/v1/batches``: create (input checked line by line), retrieve, list, cancel, and the batch object in OpenAI's
shape. Statuses: validating -> in_progress -> finalizing -> completed, or failed (a bad input file),
cancelling -> cancelled, expired (not done within the 24h window). The worker (``worker.py``) moves them on."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from sqlalchemy import insert, select
from sqlalchemy.orm import Session

from tokenfab.server.batch.config import BATCH_WINDOW_SECONDS
from tokenfab.server.batch.db import BatchLineRow, BatchRow, Database
from tokenfab.server.batch.files import FileStore, after_cursor, sortable_id
from tokenfab.server.batch.validation import ENDPOINTS, check_input
from tokenfab.server.errors import APIError

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")  # the worker still has something to do
MAX_METADATA_PAIRS, MAX_METADATA_KEY, MAX_METADATA_VALUE = 16, 64, 512


def batch_object(row: BatchRow) -> dict[str, Any]:
    errors = None
    if row.errors:
        errors = {"object": "list", "data": row.errors}
    return {
        "id": row.id, "object": "batch", "endpoint": row.endpoint, "errors": errors,
        "input_file_id": row.input_file_id, "completion_window": row.completion_window, "status": row.status,
        "output_file_id": row.output_file_id, "error_file_id": row.error_file_id, "created_at": row.created_at,
        "in_progress_at": row.in_progress_at, "expires_at": row.expires_at, "finalizing_at": row.finalizing_at,
        "completed_at": row.completed_at, "failed_at": row.failed_at, "expired_at": row.expired_at,
        "cancelling_at": row.cancelling_at, "cancelled_at": row.cancelled_at,
        "request_counts": {"total": row.total, "completed": row.completed, "failed": row.failed},
        "metadata": row.metadata_, "model": row.model,
        "usage": {"input_tokens": row.input_tokens, "output_tokens": row.output_tokens,
                  "input_tokens_details": {"cached_tokens": row.cached_tokens},
                  "output_tokens_details": {"reasoning_tokens": row.reasoning_tokens},
                  "total_tokens": row.input_tokens + row.output_tokens},
    }


def check_metadata(metadata: Any) -> dict[str, str] | None:
    if metadata is None:
        return None
    if not isinstance(metadata, dict) or len(metadata) > MAX_METADATA_PAIRS or not all(
            isinstance(k, str) and isinstance(v, str) and len(k) <= MAX_METADATA_KEY and len(v) <= MAX_METADATA_VALUE
            for k, v in metadata.items()):
        raise APIError(400, f"metadata: at most {MAX_METADATA_PAIRS} pairs of strings (keys up to "
                       f"{MAX_METADATA_KEY} characters, values up to {MAX_METADATA_VALUE})", param="metadata")
    return metadata


class BatchStore:
    def __init__(self, db: Database, files: FileStore, model: str | None = None) -> None:
        self.db = db
        self.files = files
        self.model = model  # the served model, the batch object's `model`

    async def create(self, input_file_id: str, endpoint: str, completion_window: str,
                     metadata: dict[str, str] | None) -> dict[str, Any]:
        if endpoint not in ENDPOINTS:
            raise APIError(400, f"endpoint must be one of {', '.join(ENDPOINTS)}, got {endpoint!r}", param="endpoint")
        if completion_window != "24h":
            raise APIError(400, "completion_window must be '24h'", param="completion_window")
        metadata = check_metadata(metadata)
        source = await self.files.get(input_file_id, "input_file_id")
        if source.purpose != "batch":
            raise APIError(400, f"File {input_file_id} has purpose '{source.purpose}'; a batch input must be "
                           "uploaded with purpose 'batch'", param="input_file_id")
        checked = await asyncio.to_thread(check_input, self.files.path_of(source), endpoint)
        now = int(time.time())
        row = BatchRow(id=sortable_id("batch_"), status="validating", endpoint=endpoint,
                       input_file_id=input_file_id, completion_window=completion_window, created_at=now,
                       expires_at=now + BATCH_WINDOW_SECONDS, metadata_=metadata, total=0, completed=0, failed=0,
                       model=self.model, input_tokens=0, cached_tokens=0, output_tokens=0, reasoning_tokens=0)
        if checked.errors:  # OpenAI's way: the batch exists, failed, with each bad line's number
            row.status, row.failed_at, row.errors = "failed", now, checked.errors
        else:
            row.total = len(checked.lines)

        def store(s: Session) -> None:
            s.add(row)
            s.flush()
            if not checked.errors:
                s.execute(insert(BatchLineRow), [{"batch_id": row.id, "line": n, "custom_id": c, "done": False,
                                                  "failed": False} for n, c in checked.lines])

        await self.db.run(store)
        return batch_object(row)

    async def get_row(self, batch_id: str) -> BatchRow:
        row = await self.db.run(lambda s: s.get(BatchRow, batch_id))
        if row is None:
            raise APIError(404, f"No such Batch object: {batch_id}", param="batch_id", code="batch_not_found")
        return row

    async def retrieve(self, batch_id: str) -> dict[str, Any]:
        return batch_object(await self.get_row(batch_id))

    async def list_batches(self, limit: int, after: str | None) -> dict[str, Any]:
        def query(s: Session) -> tuple[list[BatchRow], bool]:
            q = select(BatchRow)
            if after is not None:
                cursor = s.get(BatchRow, after)
                if cursor is None:
                    raise APIError(400, f"after: no such batch {after}", param="after")
                q = q.where(after_cursor(BatchRow, cursor.created_at, cursor.id, desc=True))
            rows = list(s.scalars(q.order_by(BatchRow.created_at.desc(), BatchRow.id.desc()).limit(limit + 1)))
            return rows[:limit], len(rows) > limit

        rows, more = await self.db.run(query)
        data = [batch_object(r) for r in rows]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    async def cancel(self, batch_id: str) -> dict[str, Any]:
        def mark(s: Session) -> BatchRow | None:
            row = s.get(BatchRow, batch_id)
            if row is not None and row.status in ("validating", "in_progress"):
                row.status, row.cancelling_at = "cancelling", int(time.time())
            return row

        row = await self.db.run(mark)
        if row is None:
            raise APIError(404, f"No such Batch object: {batch_id}", param="batch_id", code="batch_not_found")
        if row.status not in ("cancelling", "cancelled"):
            raise APIError(409, f"Cannot cancel a batch with status '{row.status}'", param="batch_id",
                           code="batch_not_cancellable")
        return batch_object(row)

    async def in_use(self, file_id: str) -> str | None:
        """The id of an unfinished batch reading ``file_id``, if any."""
        return await self.db.run(lambda s: s.scalars(select(BatchRow.id).where(
            BatchRow.input_file_id == file_id, BatchRow.status.in_(ACTIVE)).limit(1)).first())
