"""The fine-tuning tables, on the same SQLAlchemy metadata (and so the same database) as the Files and Batches
API (``tokenfab.server.batch.db``): one row a job, its events (``seq`` orders them), its checkpoints."""

from __future__ import annotations

from sqlalchemy import JSON, BigInteger, Float, ForeignKey, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from tokenfab.server.batch.db import Base


class FineTuningJobRow(Base):
    __tablename__ = "tokenfab_fine_tuning_jobs"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    status: Mapped[str] = mapped_column(String(24), index=True)
    model: Mapped[str] = mapped_column(String(256))
    training_file: Mapped[str] = mapped_column(String(64))
    validation_file: Mapped[str | None] = mapped_column(String(64), nullable=True)
    suffix: Mapped[str | None] = mapped_column(String(64), nullable=True)
    seed: Mapped[int] = mapped_column(BigInteger)
    method: Mapped[dict] = mapped_column(JSON)  # {type: "supervised", supervised: {hyperparameters: {...}}}
    metadata_: Mapped[dict | None] = mapped_column("metadata", JSON, nullable=True)
    created_at: Mapped[int] = mapped_column(BigInteger, index=True)
    finished_at: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    fine_tuned_model: Mapped[str | None] = mapped_column(String(512), nullable=True)
    error: Mapped[dict | None] = mapped_column(JSON, nullable=True)  # {code, message, param}
    trained_tokens: Mapped[int | None] = mapped_column(BigInteger, nullable=True)
    result_files: Mapped[list | None] = mapped_column(JSON, nullable=True)
    adapter_path: Mapped[str | None] = mapped_column(String(1024), nullable=True)  # relative to the data dir
    owner: Mapped[str | None] = mapped_column(String(64), nullable=True)  # the server whose worker runs it
    heartbeat_at: Mapped[float | None] = mapped_column(Float, nullable=True)
    pid: Mapped[int | None] = mapped_column(Integer, nullable=True)  # the training subprocess
    device: Mapped[str | None] = mapped_column(String(300), nullable=True)  # host and device it trains on


class FineTuningEventRow(Base):
    __tablename__ = "tokenfab_fine_tuning_events"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("tokenfab_fine_tuning_jobs.id", ondelete="CASCADE"), index=True)
    seq: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[int] = mapped_column(BigInteger)
    level: Mapped[str] = mapped_column(String(8))
    type: Mapped[str] = mapped_column(String(8))  # "message" or "metrics"
    message: Mapped[str] = mapped_column(Text)
    data: Mapped[dict | None] = mapped_column(JSON, nullable=True)


class FineTuningCheckpointRow(Base):
    __tablename__ = "tokenfab_fine_tuning_checkpoints"
    id: Mapped[str] = mapped_column(String(64), primary_key=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("tokenfab_fine_tuning_jobs.id", ondelete="CASCADE"), index=True)
    step_number: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[int] = mapped_column(BigInteger)
    fine_tuned_model_checkpoint: Mapped[str] = mapped_column(String(600))
    metrics: Mapped[dict] = mapped_column(JSON)
    path: Mapped[str] = mapped_column(String(1024))  # relative to the data dir
