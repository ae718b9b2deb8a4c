"""A stand-in engine-core process for the client's failure tests (test_core_process.py, test_core_hang.py):
it binds the core's socket and knows a fake model's handshake answer (``info``); what it does with the
messages is the caller's ``loop``, Python source that reads ``sock``, ``ipc`` and ``info``."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

_SETUP = """
import sys, time, zmq
from tokenfab.engine.core import ipc
sock = zmq.Context().socket(zmq.ROUTER)
sock.bind(sys.argv[1])
info = {"model_name": "fake", "max_model_len": 64, "vocab_size": 100, "eos_token_ids": [0],
        "kv_cache_tokens": 640, "scheduling_policy": "fcfs", "pid": 0, "stats": None}
"""


@contextmanager
def fake_core_process(tmp_path: Path, loop: str) -> Iterator[tuple[str, subprocess.Popen]]:
    """(its address, the process) while it runs; killed afterwards, stopped (SIGSTOP) or not."""
    address = f"ipc://{tmp_path}/fake.sock"
    proc = subprocess.Popen([sys.executable, "-c", _SETUP + textwrap.dedent(loop), address])
    try:
        yield address, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
            proc.kill()
        proc.wait()
