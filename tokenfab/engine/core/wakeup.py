"""Waking a front end's ``step()`` from another thread: a non-blocking self-pipe that a zmq poller
(or ``select``) waits on beside the engine core's sockets.

``EngineCoreClient`` and ``DPClient`` both block in ``step()`` until outputs arrive or new work is
queued (``AsyncEngine`` calls ``wakeup()`` when it hands over a request or an abort, a watchdog when
the core died). ``set()`` never blocks and never fails: a full pipe is already "set".
"""

from __future__ import annotations

import os


class WakeupPipe:
    """A self-pipe: ``set()`` from any thread makes ``fd`` readable until ``clear()``."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)

    @property
    def fd(self) -> int:
        """The read end, to register with a poller."""
        return self._r

    def set(self) -> None:
        try:
            os.write(self._w, b"x")
        except (BlockingIOError, OSError):  # full (already set) or closed
            pass

    def clear(self) -> None:
        try:
            while os.read(self._r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def close(self) -> None:
        for fd in (self._r, self._w):
            try:
                os.close(fd)
            except OSError:
                pass

