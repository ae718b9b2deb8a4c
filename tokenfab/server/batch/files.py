"""The file store behind ``/v1/files``: bytes under ``<data dir>/files/<id>``, metadata in ``tokenfab_files``,
objects in OpenAI's shape (``id`` "file-...", ``object`` "file", ``bytes``, ``created_at``, ``filename``,
``purpose``, ``status``)."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, BinaryIO

from sqlalchemy import ColumnElement, and_, or_, select
from sqlalchemy.orm import Session

from tokenfab.server.batch.db import Database, FileRow
from tokenfab.server.errors import APIError

PURPOSES = ("batch", "fine-tune", "batch_output", "user_data", "assistants", "vision", "evals")
UPLOAD_PURPOSES = ("batch", "fine-tune", "user_data", "assistants", "vision", "evals")  # batch_output: ours only


def sortable_id(prefix: str) -> str:
    """``prefix`` + microseconds since the epoch (fixed width) + randomness: ids sort in creation order, so the
    listings' (created_at, id) order is chronological within a second too."""
    return f"{prefix}{time.time_ns() // 1000:014x}{secrets.token_hex(5)}"


def new_file_id() -> str:
    return sortable_id("file-")


def file_object(row: FileRow) -> dict[str, Any]:
    return {"id": row.id, "object": "file", "bytes": row.bytes, "created_at": row.created_at,
            "filename": row.filename, "purpose": row.purpose, "status": row.status, "expires_at": None,
            "status_details": None}


def after_cursor(table: Any, created_at: int, row_id: str, desc: bool) -> ColumnElement[bool]:
    """Rows after (created_at, id) in the listing's order (portable SQL: no row-value comparison)."""
    if desc:
        return or_(table.created_at < created_at, and_(table.created_at == created_at, table.id < row_id))
    return or_(table.created_at > created_at, and_(table.created_at == created_at, table.id > row_id))


class FileStore:
    def __init__(self, db: Database, data_dir: Path) -> None:
        self.db = db
        self.root = Path(data_dir)
        (self.root / "files").mkdir(parents=True, exist_ok=True)

    def path_of(self, row: FileRow) -> Path:
        return self.root / row.path

    def write(self, source: BinaryIO | Path, filename: str, purpose: str) -> FileRow:
        """``source`` (an open binary file copied, or a path moved) put in place; the row to insert (blocking)."""
        file_id = new_file_id()
        rel = f"files/{file_id}"
        dest = self.root / rel
        if isinstance(source, Path):
            os.replace(source, dest)
        else:
            tmp = dest.with_suffix(".part")
            with open(tmp, "wb") as out:
                shutil.copyfileobj(source, out, 1 << 20)
                out.flush()
                os.fsync(out.fileno())
            os.replace(tmp, dest)
        return FileRow(id=file_id, filename=filename, purpose=purpose, bytes=dest.stat().st_size,
                       created_at=int(time.time()), status="processed", path=rel)

    async def add(self, source: BinaryIO | Path, filename: str, purpose: str) -> FileRow:
        row = await asyncio.to_thread(self.write, source, filename, purpose)
        await self.db.run(lambda s: s.add(row))
        return row

    async def get(self, file_id: str, param: str = "file_id") -> FileRow:
        row = await self.db.run(lambda s: s.get(FileRow, file_id))
        if row is None:
            raise APIError(404, f"No such File object: {file_id}", param=param, code="file_not_found")
        return row

    async def list_files(self, purpose: str | None, limit: int, order: str, after: str | None) -> dict[str, Any]:
        def query(s: Session) -> tuple[list[FileRow], bool]:
            q = select(FileRow)
            if purpose is not None:
                q = q.where(FileRow.purpose == purpose)
            desc = order == "desc"
            if after is not None:
                cursor = s.get(FileRow, after)
                if cursor is None:
                    raise APIError(400, f"after: no such file {after}", param="after")
                q = q.where(after_cursor(FileRow, cursor.created_at, cursor.id, desc))
            if desc:
                q = q.order_by(FileRow.created_at.desc(), FileRow.id.desc())
            else:
                q = q.order_by(FileRow.created_at, FileRow.id)
            rows = list(s.scalars(q.limit(limit + 1)))
            return rows[:limit], len(rows) > limit

        rows, more = await self.db.run(query)
        data = [file_object(r) for r in rows]
        return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
                "last_id": data[-1]["id"] if data else None, "has_more": more}

    async def delete(self, file_id: str) -> dict[str, Any]:
        def remove(s: Session) -> FileRow | None:
            row = s.get(FileRow, file_id)
            if row is not None:
                s.delete(row)
            return row

        row = await self.db.run(remove)
        if row is None:
            raise APIError(404, f"No such File object: {file_id}", param="file_id", code="file_not_found")
        self.path_of(row).unlink(missing_ok=True)
        return {"id": file_id, "object": "file", "deleted": True}
