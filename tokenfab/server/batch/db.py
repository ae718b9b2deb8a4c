"""The metadata database (SQLAlchemy 2): files, batches and each batch line's state.

Portable SQL only (no dialect-specific statements): SQLite embedded in the data directory by default,
PostgreSQL (or any SQLAlchemy URL) when several API servers share the work. Every statement runs on one
thread of its own (``Database.run``), so the event loop never waits on a commit and a SQLite connection is
used by one thread at a time.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    Float,
    ForeignKey,
    Integer,
    String,
    UniqueConstraint,
    create_engine,
    event,
    inspect,
)
from sqlalchemy.exc import IntegrityError, OperationalError, ProgrammingError
from sqlalchemy.orm import DeclarativeBase, Mapped, Session, mapped_column, sessionmaker

T = TypeVar("T")


class Base(DeclarativeBase):
    pass


class FileRow(Base):
    __tablename__ = "tokenfab_files"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    filename: Mapped[str] = mapped_column(String(1024))
    purpose: Mapped[str] = mapped_column(String(32), index=True)
    bytes: Mapped[int] = mapped_column(BigInteger)
    created_at: Mapped[int] = mapped_column(BigInteger, index=True)
    status: Mapped[str] = mapped_column(String(16))
    path: Mapped[str] = mapped_column(String(1024))  # relative to the data directory


class BatchRow(Base):
    __tablename__ = "tokenfab_batches"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    status: Mapped[str] = mapped_column(String(16), index=True)
    endpoint: Mapped[str] = mapped_column(String(64))
    input_file_id: Mapped[str] = mapped_column(String(64))
    completion_window: Mapped[str] = mapped_column(String(8))
    created_at: Mapped[int] = mapped_column(BigInteger, index=True)
    expires_at: Mapped[int] = mapped_column(BigInteger)
    in_progress_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    finalizing_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    completed_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    failed_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    expired_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    cancelling_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    cancelled_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    output_file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    error_file_id: Mapped[str | None] = mapped_column(String(64), nullable=True)
    total: Mapped[int] = mapped_column(Integer, default=0)
    completed: Mapped[int] = mapped_column(Integer, default=0)
    failed: Mapped[int] = mapped_column(Integer, default=0)
    model: Mapped[str | None] = mapped_column(String(256), nullable=True)
    input_tokens: Mapped[int] = mapped_column(BigInteger, default=0)  # usage, summed over the answered lines
    cached_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    output_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    reasoning_tokens: Mapped[int] = mapped_column(BigInteger, default=0)
    metadata_: Mapped[dict | None] = mapped_column("metadata", JSON, nullable=True)
    errors: Mapped[list | None] = mapped_column(JSON, nullable=True)  # [{code, message, param, line}]
    owner: Mapped[str | None] = mapped_column(String(64), nullable=True)  # the worker holding the lease
    heartbeat_at: Mapped[float | None] = mapped_column(Float, nullable=True)


class BatchLineRow(Base):
    """One input line: pending until its result line is in the batch's output or error file."""

    __tablename__ = "tokenfab_batch_lines"
    __table_args__ = (UniqueConstraint("batch_id", "custom_id"),)
    batch_id: Mapped[str] = mapped_column(ForeignKey("tokenfab_batches.id", ondelete="CASCADE"), primary_key=True)
    line: Mapped[int] = mapped_column(Integer, primary_key=True)  # 1-based line number in the input file
    custom_id: Mapped[str] = mapped_column(String(512))
    done: Mapped[bool] = mapped_column(Boolean, default=False, index=True)
    failed: Mapped[bool] = mapped_column(Boolean, default=False)


def _check_schema(engine: Any) -> None:
    """A database made by an older tokenfab (a column missing) is refused at start, not at the first query."""
    inspector = inspect(engine)
    for table in Base.metadata.sorted_tables:
        have = {c["name"] for c in inspector.get_columns(table.name)}
        missing = [c.name for c in table.columns if c.name not in have]
        if missing:
            raise RuntimeError(f"the batch database {engine.url!r} has an older schema (table {table.name} lacks "
                               f"{', '.join(missing)}): point --data-dir/--database-url elsewhere or migrate it")


def _sqlite_wal(connection: Any, _record: Any) -> None:
    """SQLite in write-ahead-log mode: readers (other API servers, list calls) do not wait for a writer."""
    cursor = connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.close()


class Database:
    """An engine, its sessions, and the one thread every statement runs on."""

    def __init__(self, url: str) -> None:
        kwargs: dict[str, Any] = {}
        if url.startswith("sqlite"):
            kwargs["connect_args"] = {"check_same_thread": False, "timeout": 30}
        self.engine = create_engine(url, **kwargs)
        if url.startswith("sqlite"):
            event.listen(self.engine, "connect", _sqlite_wal)
        for attempt in range(5):  # API servers starting together race to create the tables: the loser retries
            try:
                Base.metadata.create_all(self.engine)
                break
            except (OperationalError, ProgrammingError, IntegrityError):
                if attempt == 4:
                    raise
                time.sleep(0.2 * (attempt + 1))
        _check_schema(self.engine)
        self.session = sessionmaker(self.engine, expire_on_commit=False)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenfab-db")

    async def run(self, fn: Callable[[Session], T]) -> T:
        """``fn(session)`` on the database thread, committed when it returns."""
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.call, fn)

    def call(self, fn: Callable[[Session], T]) -> T:
        """``fn(session)`` here and now, committed when it returns (offline use, and the database thread)."""
        with self.session() as session, session.begin():
            return fn(session)

    def close(self) -> None:
        self._thread.shutdown(wait=True)
        self.engine.dispose()
