"""The API server's handle on an engine core in another process (``core_process``).

``EngineCoreClient`` quacks like ``LLMEngine`` where ``AsyncEngine`` drives it (``add_request``,
``abort_request``, ``has_unfinished_requests``, ``step``, ``get_stats``, ``check_request``), so the
server and ``AsyncEngine`` stay as they are: ``step()`` waits on the core's socket instead of
running the model, and turns the token ids that arrive into text with ``OutputProcessor`` (the
same code ``LLMEngine`` runs in process). A stop string found here aborts the request in the core.

Death is noticed at once: a watchdog thread waits on the core's pidfd (readable the moment the
process exits, however it died) and calls ``on_dead``; a ``step()`` in progress wakes up and raises
``EngineDeadError``. ``wakeup()`` lets another thread interrupt a waiting ``step()`` (new work).

A hung core (alive but not stepping: stuck in a kernel, a deadlocked collective, SIGSTOPped) is
dead too: the core's loop sends a heartbeat (``core_process.BEAT_S``) to every front end with
requests in flight, and when nothing has arrived for ``hang_timeout`` seconds while requests are
outstanding, the watchdog marks the engine dead (streams end with an error, 503, failing /health)
and SIGKILLs the core through its pidfd, so a later SIGCONT resurrects nothing: the server stays
dead until restarted, as after a crash. The default (``HANG_TIMEOUT_S``, 120 s; env
``TOKENFAB_ENGINE_HANG_TIMEOUT``, 0 = off) is generous on purpose: it must exceed the longest
legitimate single step -- a full token-budget prefill of a large model on a small CPU, or the first
step's JIT (Triton compilation, autotuning) on a GPU -- because a false alarm kills a healthy server.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import select
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from tokenfab.engine.args import EngineArgs
from tokenfab.engine.core import ipc
from tokenfab.engine.core.launch import CoreLaunch, load_tokenizer
from tokenfab.engine.core.process import EXIT_TP_WORKER_DIED, pid_alive, pid_fd
from tokenfab.engine.core.wakeup import WakeupPipe
from tokenfab.engine.intake import RequestLimits, tokenize_prompt
from tokenfab.engine.output_processor import OutputProcessor
from tokenfab.engine.requests.errors import EngineDeadError
from tokenfab.engine.requests.lora_request import LoRARequest
from tokenfab.engine.requests.outputs import RequestOutput
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.engine.requests.stats import EngineStats

log = logging.getLogger("tokenfab.core_client")
_STATS_FIELDS = tuple(f.name for f in dataclasses.fields(EngineStats))
HANG_TIMEOUT_S = 120.0  # silence with requests in flight after which the core counts as hung (above)


def hang_timeout_from_env() -> float:
    """``TOKENFAB_ENGINE_HANG_TIMEOUT`` in seconds (0 turns hang detection off), else ``HANG_TIMEOUT_S``."""
    raw = os.environ.get("TOKENFAB_ENGINE_HANG_TIMEOUT")
    if raw is None or not raw.strip():
        return HANG_TIMEOUT_S
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"TOKENFAB_ENGINE_HANG_TIMEOUT must be a number of seconds, got {raw!r}") from None
    if not value >= 0 or value == float("inf"):
        raise ValueError(f"TOKENFAB_ENGINE_HANG_TIMEOUT must be >= 0 seconds (0 = off), got {raw!r}")
    return value


class EngineCoreClient:
    """One front end's connection to the engine core (a DEALER on the core's ROUTER)."""

    def __init__(self, address: str, core_pid: int, tokenizer: Any, proc: subprocess.Popen | None = None,
                 ready_timeout: float = 3600.0, workdir: str | None = None,
                 hang_timeout: float | None = None) -> None:
        self.address = address
        self.hang_timeout = hang_timeout_from_env() if hang_timeout is None else float(hang_timeout)
        self.core_pid = core_pid
        self.tokenizer = tokenizer
        self.proc = proc  # set when this client spawned (and owns) the core
        self._workdir = workdir
        self.on_dead: Callable[[EngineDeadError], None] | None = None
        self._dead: str | None = None
        self._closing = False  # a core that exits after our shutdown message did not "die"
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, f"fe-{os.getpid()}-{id(self):x}".encode())
        self.sock.connect(address)
        self._wake = WakeupPipe()  # new work for a waiting step()
        self._pidfd = pid_fd(core_pid)
        info = self._handshake(ready_timeout)
        self.info = info
        self.model_name: str = info["model_name"]
        self.max_model_len: int = info["max_model_len"]
        self.vocab_size: int = info["vocab_size"]
        self.eos_token_ids: list[int] = info["eos_token_ids"]
        self.kv_cache_tokens: int = info["kv_cache_tokens"]
        self.scheduling_policy: str = info["scheduling_policy"]
        self.lora_targets: dict | None = info.get("lora_targets")  # --enable-lora: what adapters may target
        self.limits = RequestLimits(self.vocab_size, self.max_model_len, self.kv_cache_tokens)
        self.processor = OutputProcessor(tokenizer, self.eos_token_ids)
        self._inflight: set[str] = set()
        self._stats: dict[str, Any] | None = info.get("stats")
        # messages sent / seen by the core (as of its last stats): while some are on the wire the
        # client counts as busy, so the stats it reports are never older than its own requests
        self._adds_sent = self._adds_acked = self._aborts_sent = self._aborts_acked = 0
        self._poller = zmq.Poller()
        self._poller.register(self.sock, zmq.POLLIN)
        self._poller.register(self._wake.fd, zmq.POLLIN)
        self._stop = WakeupPipe()  # close() ends the watchdog
        self._last_heard = time.monotonic()  # the last frame from the core (hang detection)
        self._watchdog = threading.Thread(target=self._watch, name="tokenfab-core-watchdog", daemon=True)
        self._watchdog.start()

    # ---- start-up ----
    @classmethod
    def spawn(cls, args: EngineArgs, log_level: str = "info") -> EngineCoreClient:
        """Start ``python -m tokenfab.engine.core.process`` and connect; RuntimeError if it fails to load."""
        launch = CoreLaunch.start(args, log_level)
        return cls.connect(launch, load_tokenizer(args.model))

    @classmethod
    def connect(cls, launch: CoreLaunch, tokenizer: Any) -> EngineCoreClient:
        """Connect to a started core (waits for it to load); on failure the core is stopped."""
        try:
            return cls(launch.address, launch.proc.pid, tokenizer, proc=launch.proc, workdir=launch.workdir)
        except BaseException:
            launch.kill()
            raise

    def _handshake(self, timeout: float) -> dict[str, Any]:
        self.sock.send(ipc.encode("hello"))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.sock.poll(200, zmq.POLLIN):
                tag, fields = ipc.decode(self.sock.recv())
                if tag == "ready":
                    return fields[0]
                if tag == "dead":
                    raise RuntimeError(f"the engine core failed: {fields[0]}")
                continue
            if not self._core_alive():
                code = self.proc.poll() if self.proc is not None else None
                raise RuntimeError(f"the engine core exited before it was ready (exit code {code}; see its log)")
        raise RuntimeError(f"the engine core was not ready after {timeout:.0f} s")

    # ---- liveness ----
    def _core_alive(self) -> bool:
        if self.proc is not None:
            return self.proc.poll() is None
        if self._pidfd is not None:
            return not select.select([self._pidfd], [], [], 0)[0]
        return pid_alive(self.core_pid)

    def _watch(self) -> None:
        tick = 0.5 if self._pidfd is None else None
        if self.hang_timeout > 0:
            tick = min(tick or 1.0, self.hang_timeout / 4)
        while self._dead is None:
            fds = [self._stop.fd] + ([self._pidfd] if self._pidfd is not None else [])
            ready = select.select(fds, [], [], tick)[0]
            if self._stop.fd in ready or self._closing:
                return
            if self._hung():
                return
            if (self._pidfd is not None and self._pidfd in ready) or not self._core_alive():
                code = self.proc.wait() if self.proc is not None else None
                how = f" (exit code {code})" if code is not None and code >= 0 else \
                    f" (killed by signal {-code})" if code is not None else ""
                if code == EXIT_TP_WORKER_DIED:
                    how += ": a tensor-parallel worker died"
                time.sleep(0.2)  # a step() reading the core's "dead" frame reports the exact reason first
                self._mark_dead(f"the engine core process (pid {self.core_pid}) died{how}")
                return

    def _hung(self) -> bool:
        """Requests in flight and no frame for ``hang_timeout`` s: mark the engine dead, kill the core."""
        if self.hang_timeout <= 0 or not self.has_unfinished_requests():
            return False
        silent = time.monotonic() - self._last_heard
        if silent <= self.hang_timeout or not self._core_alive():
            return False  # (an exited core is reported as died, below)
        self._mark_dead(f"the engine core process (pid {self.core_pid}) is hung: nothing from it for {silent:.1f} s "
                        f"with requests in flight (bound {self.hang_timeout:g} s; stuck in a kernel or a "
                        "collective?); it was killed")
        self._kill_core()
        return True

    def _kill_core(self) -> None:
        """SIGKILL the core: through its pidfd (no pid-reuse race) where there is one."""
        try:
            if self._pidfd is not None:
                signal.pidfd_send_signal(self._pidfd, signal.SIGKILL)
            elif self.proc is not None:
                self.proc.kill()
            elif pid_alive(self.core_pid):
                os.kill(self.core_pid, signal.SIGKILL)
        except (OSError, AttributeError) as e:
            log.warning("could not kill the hung engine core (pid %d): %s", self.core_pid, e)

    def _mark_dead(self, message: str) -> None:
        if self._dead is not None:
            return
        self._dead = message
        log.error("%s", message)
        self.wakeup()
        if self.on_dead is not None:
            try:
                self.on_dead(EngineDeadError(message))
            except Exception:  # pragma: no cover
                log.exception("on_dead callback failed")

    @property
    def is_dead(self) -> bool:
        return self._dead is not None

    def wakeup(self) -> None:
        """Interrupt a ``step()`` waiting for outputs (any thread)."""
        self._wake.set()

    @property
    def wake_fd(self) -> int:
        """Readable while a ``wakeup()`` is pending (``DPClient`` polls it beside ``sock``)."""
        return self._wake.fd

    # ---- the LLMEngine face ----
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.limits.check(prompt_token_ids, params)  # the very checks LLMEngine runs (engine/intake.py)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    priority: int = 0, cache_salt: str | None = None, lora_request: LoRARequest | None = None) -> None:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        params = params or SamplingParams()
        if request_id in self._inflight:
            raise ValueError(f"request id {request_id!r} is already in use")
        ids = list(tokenize_prompt(self.tokenizer, prompt)[1])  # as LLMEngine tokenizes (engine/intake.py)
        self.check_request(ids, params)
        if not self.has_unfinished_requests():  # work starts now: the hang clock too
            self._last_heard = time.monotonic()
        spec = None
        if params.constraint is not None:
            spec = getattr(params.constraint, "spec_json", None)
            if spec is None:
                raise ValueError("this constraint cannot be sent to the engine process (no spec_json)")
        self._send(ipc.encode("add", request_id, ids, ipc.params_to_wire(params), int(priority), cache_salt,
                              spec, time.time(), lora_request.to_wire() if lora_request is not None else None))
        self.processor.add(request_id, ids, params)
        self._inflight.add(request_id)
        self._adds_sent += 1

    def abort_request(self, request_id: str) -> None:
        if request_id in self._inflight:
            self._inflight.discard(request_id)
            self.processor.remove(request_id)
            self._send_abort([request_id])

    def _send_abort(self, request_ids: list[str]) -> None:
        self._send(ipc.encode("abort", request_ids))
        self._aborts_sent += 1

    def has_unfinished_requests(self) -> bool:
        return bool(self._inflight) or self._adds_sent > self._adds_acked or self._aborts_sent > self._aborts_acked

    def step(self, timeout_ms: int = 1000) -> list[RequestOutput]:
        """The outputs that arrived; waits up to ``timeout_ms`` for some (or a ``wakeup``)."""
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        events = dict(self._poller.poll(timeout_ms))
        if self._wake.fd in events:
            self._wake.clear()
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        outputs: list[RequestOutput] = []
        stopped: list[str] = []
        while True:
            try:
                frame = self.sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._last_heard = time.monotonic()
            try:
                tag, fields = ipc.decode(frame)
            except ipc.ProtocolError as e:
                log.warning("dropped a malformed frame from the engine core: %s", e)
                continue
            if tag == "dead":
                self._mark_dead(f"the engine core failed: {fields[0]}")
                raise EngineDeadError(self._dead)
            if tag != "outputs":
                continue
            records, stats = fields
            for rec in records:
                out = self.processor.process(*rec[:8], stopped, kv_transfer_params=rec[8] if len(rec) > 8 else None)
                if out is not None:
                    outputs.append(out)
                    if out.finished:
                        self._inflight.discard(out.request_id)
            if stats is not None:
                self._adds_acked = int(stats.pop("adds_received", self._adds_acked))
                self._aborts_acked = int(stats.pop("aborts_received", self._aborts_acked))
                self._stats = stats
        if stopped:  # a stop string ended them here: the core stops too
            self._send_abort(stopped)
        return outputs

    def get_stats(self) -> EngineStats | None:
        s = self._stats
        if s is None or not all(f in s for f in _STATS_FIELDS):
            return None
        stats = EngineStats(**{f: s[f] for f in _STATS_FIELDS})
        stats.num_waiting += max(0, self._adds_sent - self._adds_acked)  # on the wire, not yet seen
        return stats

    def _send(self, frame: bytes) -> None:
        try:
            self.sock.send(frame, zmq.NOBLOCK)
        except zmq.Again:  # the core stopped reading: it is dead or about to be found so
            log.warning("the engine core is not taking messages")

    # ---- shutdown ----
    def close(self, timeout: float = 10.0) -> None:
        """Disconnect; when this client started the core, stop it (shutdown message, then signals)."""
        self._closing = True
        if self.proc is not None and self.proc.poll() is None:
            self._send(ipc.encode("shutdown"))
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.terminate()
                try:
                    self.proc.wait(5)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        self._dead = self._dead or "the engine core was shut down"
        self._stop.set()
        self._watchdog.join(2)
        self.sock.close(0)
        self._ctx.term()
        self._wake.close()
        self._stop.close()
        if self._pidfd is not None:
            try:
                os.close(self._pidfd)
            except OSError:
                pass
        if self._workdir is not None:
            shutil.rmtree(self._workdir, ignore_errors=True)
