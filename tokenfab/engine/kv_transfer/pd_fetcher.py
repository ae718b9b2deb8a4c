"""The consumer's KV reads, off the engine thread: one background thread runs each decode leg's fetch (its prompt
digests, the NIXL read into staging) while the engine keeps stepping the streams it already runs.

The engine parks a decode leg (``engine/runner/pd_hook.py``: not queued in the scheduler) when it arrives and
submits a ``FetchJob``; the thread runs the job and marks it done; the engine, at the start of its next step, takes
the done jobs and queues their requests, whose blocks the scheduler's admission then copies from staging into the
device cache (``PDConnector.load``, a host copy on the engine thread, as any KV-tier hit).

- One thread, jobs in arrival order: reads over one link do not go faster side by side, and the first request
  parked is the first admitted.
- The thread runs at a lower OS priority (``nice``, per thread on Linux), so where the consumer is pinned to one
  core the engine thread's decode steps win it; the read's copies fill the engine's idle moments.
- A job cancelled before it starts is skipped; one cancelled while its read is in flight finishes the read (the
  transport is writing into its slots, which must not be reused until it is done), then gives its blocks up.
- A job that raises counts as a failed fetch (0 blocks): the request is prefilled locally, never lost.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

log = logging.getLogger("tokenfab")

#: niceness added to the fetch thread (0..19): the engine thread, at the process's own, wins a shared core
FETCH_THREAD_NICENESS = 10


@dataclass
class FetchJob:
    """One decode leg's read. ``run`` (on the fetch thread) returns the blocks now held in staging; ``drop``
    gives them up again (a job cancelled after its read finished)."""

    request_id: str
    run: Callable[[], int]
    drop: Callable[[], None] = lambda: None
    cancelled: threading.Event = field(default_factory=threading.Event)
    blocks: int = 0  # set when done
    failed: bool = False  # run raised (the request prefills locally)


class BackgroundFetcher:
    def __init__(self, niceness: int = FETCH_THREAD_NICENESS, name: str = "tokenfab-kv-fetch") -> None:
        self._niceness = niceness
        self._cv = threading.Condition()
        self._queue: collections.deque[FetchJob] = collections.deque()
        self._done: list[FetchJob] = []
        self._done_event = threading.Event()  # set while a finished job waits to be taken
        self._closed = False
        self.running: FetchJob | None = None  # the job on the thread now (tests, stats)
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    # ---- the engine thread's side -----------------------------------------------------------------------
    def submit(self, job: FetchJob) -> None:
        with self._cv:
            if self._closed:
                raise RuntimeError("the KV fetch thread is closed")
            self._queue.append(job)
            self._cv.notify()

    def take_done(self) -> list[FetchJob]:
        """The jobs finished since the last call, in the order they finished (cancelled ones not among them)."""
        with self._cv:
            done, self._done = self._done, []
            self._done_event.clear()
        return done

    def wait(self, timeout: float) -> bool:
        """Block up to ``timeout`` seconds until a finished job waits to be taken; whether one does."""
        return self._done_event.wait(timeout)

    def close(self, timeout: float = 30.0) -> None:
        """Cancel what has not started, let the running read end (bounded by its own timeout), join the thread."""
        with self._cv:
            self._closed = True
            for job in self._queue:
                job.cancelled.set()
            self._queue.clear()
            if self.running is not None:
                self.running.cancelled.set()
            self._cv.notify_all()
        self._thread.join(timeout)
        if self._thread.is_alive():
            log.warning("the KV fetch thread did not end within %.0f s", timeout)

    # ---- the fetch thread -------------------------------------------------------------------------------
    def _lower_priority(self) -> None:
        if self._niceness <= 0 or not hasattr(os, "setpriority"):
            return
        with contextlib.suppress(OSError, AttributeError):  # not permitted, or not a per-thread priority
            tid = threading.get_native_id()
            os.setpriority(os.PRIO_PROCESS, tid, min(19, os.getpriority(os.PRIO_PROCESS, tid) + self._niceness))

    def _loop(self) -> None:
        self._lower_priority()
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                job = self._queue.popleft()
                if job.cancelled.is_set():
                    continue
                self.running = job
            try:
                job.blocks = job.run()
            except Exception:  # a bug or an unexpected transport error: prefill locally, never lose the request
                log.exception("KV fetch for request %s failed: prefilling locally", job.request_id)
                job.blocks, job.failed = 0, True
            with self._cv:
                cancelled = job.cancelled.is_set()
                if not cancelled:
                    self._done.append(job)
                    self._done_event.set()
            if cancelled and job.blocks:
                try:
                    job.drop()
                except Exception:
                    log.exception("could not give up the blocks of cancelled request %s", job.request_id)
            with self._cv:
                self.running = None  # after the drop: a job seen running may still hold blocks
