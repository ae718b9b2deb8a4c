"""A subprocess whose output (stdout and stderr together) a thread collects, for tests that wait for a
line of it (a server's banner, a process's pid)."""

from __future__ import annotations

import re
import subprocess
import threading
import time


class WatchedProcess:
    def __init__(self, cmd: list[str], env: dict[str, str], **popen_kwargs) -> None:
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                     **popen_kwargs)
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_for(self, pattern: str, timeout: float, poll: float = 0.05) -> re.Match:
        """The first match of ``pattern`` in the output; an AssertionError with the output when the
        process exits or ``timeout`` seconds pass first."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            m = re.search(pattern, self.output)
            if m:
                return m
            if self.proc.poll() is not None:
                break
            time.sleep(poll)
        raise AssertionError(f"output never matched {pattern!r}:\n{self.output}")
