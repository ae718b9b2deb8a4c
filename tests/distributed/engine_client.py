"""Shared by the multi-replica engine tests (test_data_parallel.py, test_dp_ep_serve.py)."""

from __future__ import annotations

import time
from typing import Any


def drain(client: Any, rids: set[str], timeout: float = 300) -> dict[str, Any]:
    """Step ``client`` until every request in ``rids`` has finished, or ``timeout`` seconds have passed;
    the finished ``RequestOutput``s by request id (a request still running is missing)."""
    done: dict[str, Any] = {}
    deadline = time.monotonic() + timeout
    while rids - done.keys() and time.monotonic() < deadline:
        for out in client.step(200):
            if out.finished:
                done[out.request_id] = out
    return done
