"""The engine core in its own process: schedule -> forward -> sample, nothing else.

``python -m tokenfab.engine.core.process --address ipc://... --args-json '{...}'`` builds an
``LLMEngine`` with ``detokenize=False`` (token ids out; the API server makes the text and checks
stop strings) and serves one ZMQ ROUTER socket: every API-server process connects a DEALER, says
``hello`` and gets ``ready`` with the model's facts. The loop drains what arrived (adds, aborts),
runs one step while work exists and pushes each front end its outputs and the engine's stats; it
blocks in ``poll`` when idle. A device error (``EngineDeadError``) is reported (``dead``) and the
process exits 1; the process also exits when its parent dies (SIGKILL leaves no orphan). A heartbeat
from the loop itself (an empty ``outputs`` at least every ``BEAT_S`` to each front end with requests
in flight) lets a front end tell a hung core (alive, not stepping) from a busy one. SIGINT
is ignored (Ctrl-C reaches the whole process group: the API server shuts the core down in order);
SIGTERM stops it.

Tensor parallel (``--tensor-parallel-size``): the core is rank 0 (``executors/tp_executor.py``). A
worker that dies makes the core send ``dead`` with the reason and exit 1 within seconds: the
loop watches the executor's death fd, a collective in flight fails (gloo sees the closed
connection) or times out, and a timer ends the process if the main thread stays stuck.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import zmq

from tokenfab.engine.args import EngineArgs
from tokenfab.engine.core import ipc
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.requests.errors import EngineDeadError
from tokenfab.engine.requests.lora_request import LoRARequest
from tokenfab.engine.requests.outputs import logprobs_to_wire
from tokenfab.engine.runner.device_setup import resolve_device
from tokenfab.engine.runner.structured import StructuredOutputCompiler
from tokenfab.executors import dp_lockstep

log = logging.getLogger("tokenfab.core")
EXIT_TP_WORKER_DIED = 4  # the exit code when a tensor-parallel worker died (the client names it)
# the loop tells each front end with requests in flight that it is alive at least this often (an
# empty ``outputs``), even through chunked prefills that emit no token for many steps
BEAT_S = 1.0


def pid_fd(pid: int) -> int | None:
    """A file descriptor that becomes readable when process ``pid`` exits (Linux pidfd), or None."""
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class EngineCore:
    """The core's loop around one ``LLMEngine``; one ROUTER socket for every front end."""

    def __init__(self, engine: Any, sock: zmq.Socket, parent_pid: int | None = None) -> None:
        self.engine = engine
        self.sock = sock
        self.parent_pid = parent_pid
        self._parent_fd = pid_fd(parent_pid) if parent_pid else None
        self._clients: dict[bytes, int] = {}  # identity -> index (engine ids are "<index>:<request id>")
        # identity -> [adds, aborts] received: the front end knows what is still on the wire
        self._seen: dict[bytes, list[int]] = {}
        self._route: dict[str, tuple[bytes, str]] = {}  # engine id -> (identity, request id)
        self._sent_prompt_lp: set[str] = set()
        self._structured: Any = None
        self._stop = False
        self._dirty: set[bytes] = set()  # front ends owed a stats update
        self._last_beat = 0.0
        self.lockstep: Any = None  # attention-DP + EP: the replicas step together (executors/dp_lockstep.py)

    # ---- facts for the handshake ----
    def info(self) -> dict[str, Any]:
        e = self.engine
        return {
            "model_name": e.model_name, "max_model_len": int(e.max_model_len), "vocab_size": int(e.vocab_size),
            "eos_token_ids": [int(t) for t in e.eos_token_ids], "kv_cache_tokens": int(e.kv_cache_tokens),
            "scheduling_policy": str(e.scheduling_policy), "pid": os.getpid(),
            "device": str(e.device), "dtype": str(e.dtype).removeprefix("torch."),
            "stats": self._stats(), "lora_targets": getattr(e, "lora_targets", None),
        }

    def _stats(self) -> dict[str, Any] | None:
        try:
            return dataclasses.asdict(self.engine.get_stats())
        except Exception:
            return None

    # ---- the loop ----
    def run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        if self._parent_fd is not None:
            poller.register(self._parent_fd, zmq.POLLIN)
        tp = getattr(self.engine, "tp", None)  # tensor parallel: a dead worker ends the core
        if tp is not None:
            poller.register(tp.death_fd, zmq.POLLIN)
            tp.on_death.append(_exit_soon)
        if self.lockstep is not None:
            return dp_lockstep.run_lockstep(self, self.lockstep, poller)
        while not self._stop:
            busy = self.engine.has_unfinished_requests()
            events = dict(poller.poll(0 if busy else 1000))
            if self._parent_gone(events):
                log.warning("the API server process is gone: the engine core exits")
                return
            if tp is not None and tp.dead is not None:
                self._die(EngineDeadError(tp.dead))
            if self.sock in events or busy:
                self._drain()
            if self._stop:
                return
            if self.engine.has_unfinished_requests():
                self._step()
            self._flush_stats()
            self._heartbeat()

    def _heartbeat(self) -> None:
        """An empty ``outputs`` to every front end with requests in flight, at most every ``BEAT_S``.
        Sent by the loop, not by a thread: a core stuck in a kernel or a collective goes silent, and
        the front end (``EngineCoreClient``, its hang bound) declares it dead."""
        now = time.monotonic()
        if now - self._last_beat < BEAT_S:
            return
        self._last_beat = now
        for ident in {ident for ident, _ in self._route.values()}:
            self._send(ident, ipc.encode("outputs", [], None))

    def _parent_gone(self, events: dict) -> bool:
        if self._parent_fd is not None:
            return self._parent_fd in events
        return self.parent_pid is not None and not pid_alive(self.parent_pid)

    def _drain(self) -> None:
        while True:
            try:
                ident, frame = self.sock.recv_multipart(zmq.NOBLOCK)[:2]
            except zmq.Again:
                return
            except ValueError:  # fewer than two parts
                continue
            try:
                tag, fields = ipc.decode(frame)
            except ipc.ProtocolError as e:
                log.warning("dropped a malformed frame: %s", e)
                continue
            self._handle(ident, tag, fields)

    def _handle(self, ident: bytes, tag: str, fields: list[Any]) -> None:
        if tag == "hello":
            self._clients.setdefault(ident, len(self._clients))
            self._seen.setdefault(ident, [0, 0])
            self._send(ident, ipc.encode("ready", self.info()))
        elif tag == "add":
            self._add(ident, *fields)
        elif tag == "abort":
            idx = self._clients.get(ident)
            self._seen.setdefault(ident, [0, 0])[1] += 1
            self._dirty.add(ident)
            for rid in fields[0]:
                eid = f"{idx}:{rid}"
                if self._route.pop(eid, None) is not None:
                    self._sent_prompt_lp.discard(eid)
                    self.engine.abort_request(eid)
        elif tag == "shutdown":
            self._stop = True
        else:
            log.warning("unexpected message %r from a front end", tag)

    def _add(self, ident: bytes, rid: str, ids: list[int], params_d: dict, priority: int,
             cache_salt: str | None, spec: str | None, _arrival: float, lora: list | None = None) -> None:
        idx = self._clients.setdefault(ident, len(self._clients))
        self._seen.setdefault(ident, [0, 0])[0] += 1
        self._dirty.add(ident)
        eid = f"{idx}:{rid}"
        try:
            params = ipc.params_from_wire(params_d)
            if spec is not None:
                params = dataclasses.replace(params, constraint=self._constraint(spec))
            self.engine.add_request(eid, ids, params, priority, cache_salt=cache_salt, prompt_token_ids=ids,
                                    lora_request=LoRARequest.from_wire(lora))
        except Exception as e:  # the front end checked it already: a mismatch of versions or a race
            log.warning("request %s rejected by the engine core: %s", rid, e)
            self._send(ident, ipc.encode("outputs", [[rid, [], None, "error", None, f"rejected: {e}", 0, None]],
                                         None))
            return
        self._route[eid] = (ident, rid)

    def _constraint(self, spec: str) -> Any:
        if self._structured is None:
            self._structured = StructuredOutputCompiler(self.engine.tokenizer, self.engine.vocab_size)
        return self._structured.from_response_format(json.loads(spec))

    def _die(self, error: EngineDeadError) -> None:
        """Tell every front end why, then raise: the process exits 1."""
        log.error("the engine core hit a fatal error: %s", error)
        for ident in self._clients:
            self._send(ident, ipc.encode("dead", str(error)))
        raise error

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except EngineDeadError as e:
            log.exception("the engine core hit a fatal error")
            self._die(e)
        except Exception as e:  # not attributable to one request: fail those in flight (as AsyncEngine does)
            log.exception("engine step failed; failing the requests in flight")
            outputs = []
            by_client: dict[bytes, list] = {}
            for eid, (ident, rid) in list(self._route.items()):
                self.engine.abort_request(eid)
                by_client.setdefault(ident, []).append([rid, [], None, "error", None, f"engine step failed: {e}",
                                                        0, None])
            self._route.clear()
            for ident, recs in by_client.items():
                self._send(ident, ipc.encode("outputs", recs, None))
        by_client = {}
        for out in outputs:
            route = self._route.get(out.request_id)
            if route is None or not out.outputs:
                continue
            by_client.setdefault(route[0], []).append(self._record(out, route[1]))
            if out.finished:
                self._route.pop(out.request_id, None)
                self._sent_prompt_lp.discard(out.request_id)
        stats = self._stats()
        for ident, recs in by_client.items():
            self._send(ident, ipc.encode("outputs", recs, self._with_acks(stats, ident)))
            self._dirty.discard(ident)

    def _record(self, out: Any, rid: str) -> list[Any]:
        co = out.outputs[0]
        new = [int(t) for t in co.delta_token_ids]
        lps = None
        if co.logprobs is not None:
            lps = [logprobs_to_wire(e) for e in co.logprobs[len(co.logprobs) - len(new):]] if new else []
        plp = None
        if out.prompt_logprobs is not None and out.request_id not in self._sent_prompt_lp \
                and (new or out.finished):
            plp = [None if e is None else logprobs_to_wire(e) for e in out.prompt_logprobs]
            self._sent_prompt_lp.add(out.request_id)
        stop = co.stop_reason if co.stop_reason is None or isinstance(co.stop_reason, (int, str)) else None
        return [rid, new, lps, co.finish_reason, stop, out.error, int(out.num_cached_tokens or 0), plp,
                out.kv_transfer_params]

    def _with_acks(self, stats: dict | None, ident: bytes) -> dict:
        adds, aborts = self._seen.get(ident, (0, 0))
        return {**(stats or {}), "adds_received": adds, "aborts_received": aborts}

    def _flush_stats(self) -> None:
        """Front ends whose adds or aborts were taken but got no output this round still learn the
        counts (and the stats after them)."""
        if not self._dirty:
            return
        stats = self._stats()
        for ident in self._dirty:
            self._send(ident, ipc.encode("outputs", [], self._with_acks(stats, ident)))
        self._dirty.clear()

    def _send(self, ident: bytes, frame: bytes) -> None:
        try:
            self.sock.send_multipart([ident, frame], zmq.NOBLOCK)
        except zmq.ZMQError as e:  # that front end is gone or not reading: its outputs are dropped
            log.debug("cannot send to a front end: %s", e)


def _exit_soon(message: str, grace: float = 10.0) -> None:
    """Second line behind the loop's own check: if the main thread is stuck (a collective that
    neither fails nor times out soon), the process still ends a few seconds after a TP worker died."""
    timer = threading.Timer(grace, os._exit, (EXIT_TP_WORKER_DIED,))
    timer.daemon = True
    timer.start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenfab-engine-core")
    parser.add_argument("--address", required=True, help="ZMQ endpoint to bind (ipc://...)")
    parser.add_argument("--args-json", required=True, help="EngineArgs as a JSON object")
    parser.add_argument("--parent-pid", type=int, default=None, help="exit when this process is gone")
    parser.add_argument("--log-level", default="info")
    ns = parser.parse_args(argv)
    logging.basicConfig(level=getattr(logging, ns.log_level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
    sock.bind(ns.address)
    flag_group, dp_rank = None, 0
    try:
        args = EngineArgs(**{**json.loads(ns.args_json), "detokenize": False})
        if dp_lockstep.MASTER_ENV in os.environ:  # attention-DP + EP: the replicas form one world first
            dp_rank, _, flag_group = dp_lockstep.join_world(resolve_device(args.device))
        engine = LLMEngine(args)
    except Exception as e:
        print(f"engine core: cannot load the model: {e}", file=sys.stderr, flush=True)
        return 3
    core = EngineCore(engine, sock, ns.parent_pid)
    if flag_group is not None:
        core.lockstep = dp_lockstep.make_lockstep(engine, flag_group, dp_rank)
    try:
        core.run()
    except EngineDeadError:
        tp = getattr(engine, "tp", None)
        return EXIT_TP_WORKER_DIED if tp is not None and tp.dead is not None else 1
    finally:
        sock.close(0)
        ctx.term()
        shutdown = getattr(engine, "shutdown", None)
        if shutdown is not None:
            shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
