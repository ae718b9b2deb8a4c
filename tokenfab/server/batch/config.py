"""Where the Files/Batches API keeps its data and how hard the batch worker may push: ``BatchConfig`` and the
server flags that fill it (``--data-dir``, ``--database-url``, ``--max-file-bytes``, ...)."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MAX_FILE_BYTES = 512 << 20
MAX_BATCH_LINES = 50_000  # OpenAI's limit on the requests of one batch
BATCH_WINDOW_SECONDS = 24 * 3600  # completion_window "24h", the only one OpenAI offers


def default_data_dir() -> Path:
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "tokenfab" / "data"


@dataclass
class BatchConfig:
    data_dir: Path
    database_url: str | None = None  # None: SQLite in data_dir/tokenfab.db
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES
    concurrency: int = 8  # batch lines in the engine at once, per API server
    lease_seconds: float = 30.0  # a batch whose owner has not renewed its lease for this long is taken over
    worker: bool = True  # run the batch worker in this process

    @property
    def url(self) -> str:
        return self.database_url or f"sqlite:///{Path(self.data_dir) / 'tokenfab.db'}"

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> BatchConfig:
        return cls(data_dir=Path(args.data_dir) if args.data_dir else default_data_dir(),
                   database_url=args.database_url, max_file_bytes=args.max_file_bytes,
                   concurrency=args.batch_concurrency, lease_seconds=args.batch_lease_seconds)

    def check(self) -> None:
        if self.max_file_bytes < 1 or self.concurrency < 1 or not self.lease_seconds > 0:
            raise ValueError("--max-file-bytes and --batch-concurrency must be at least 1, --batch-lease-seconds > 0")


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("files and batches (/v1/files, /v1/batches)")
    g.add_argument("--data-dir", default=None,
                   help=f"where uploaded files and batch results are stored (default {default_data_dir()})")
    g.add_argument("--database-url", default=None,
                   help="SQLAlchemy URL of the metadata database (default: SQLite in the data dir; "
                   "postgresql://... lets several API servers share one, with --data-dir on shared storage)")
    g.add_argument("--max-file-bytes", type=int, default=DEFAULT_MAX_FILE_BYTES,
                   help="answer 413 to an uploaded file larger than this (default 512 MiB)")
    g.add_argument("--batch-concurrency", type=int, default=8,
                   help="batch lines in the engine at once, at the lowest priority (default 8)")
    g.add_argument("--batch-lease-seconds", type=float, default=30.0,
                   help="a batch whose server stopped renewing its lease this long ago is resumed by another "
                   "(or by this one after a restart; default 30)")
