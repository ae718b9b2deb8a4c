"""A throwaway PostgreSQL server for tests (Debian's `postgresql` binaries): initdb in a temporary directory,
`postgres` on a free localhost port, trust authentication; skipped with the reason when the binaries or the
psycopg driver are absent. Run as the `postgres` user when the tests run as root (postgres refuses root)."""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest


def _as_postgres() -> list[str]:
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        pytest.skip("running as root and there is no 'postgres' user to run PostgreSQL as")
    runuser = shutil.which("runuser")
    if runuser is None:
        pytest.skip("running as root and runuser is missing")
    return [runuser, "-u", "postgres", "--"]


@contextlib.contextmanager
def postgres_url() -> Iterator[str]:
    """A SQLAlchemy URL (psycopg 3) of a fresh PostgreSQL server, stopped at exit."""
    pytest.importorskip("psycopg", reason="the psycopg driver is not installed")
    initdb, postgres = shutil.which("initdb"), shutil.which("postgres")
    if initdb is None or postgres is None:
        pytest.skip("PostgreSQL (initdb, postgres) is not installed")
    prefix = _as_postgres()
    root = tempfile.mkdtemp(prefix="tokenfab-pg-")
    os.chmod(root, 0o777)
    data = os.path.join(root, "data")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = None
    try:
        subprocess.run([*prefix, initdb, "-D", data, "-A", "trust", "-U", "tokenfab", "--no-sync"], check=True,
                       capture_output=True, timeout=120)
        proc = subprocess.Popen([*prefix, postgres, "-D", data, "-p", str(port), "-k", root, "-c",
                                 "listen_addresses=127.0.0.1", "-c", "fsync=off"],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert proc.poll() is None and time.monotonic() < deadline, "PostgreSQL did not start"
            time.sleep(0.1)
        time.sleep(0.3)  # accepting connections before it accepts logins
        yield f"postgresql+psycopg://tokenfab@127.0.0.1:{port}/postgres"
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(30)
        shutil.rmtree(root, ignore_errors=True)
