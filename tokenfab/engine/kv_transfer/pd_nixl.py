"""The transport of prefill/decode disaggregation: NIXL (NVIDIA's inference transfer library, ``pip install nixl``)
with its UCX backend, moving rows of the host staging buffers (``pd_staging.py``) between two instances.

Each instance runs one NIXL agent named by its ``engine_id``, with NIXL's own listener on ``kv_ip:kv_port`` for
the metadata exchange (no socket of ours), and registers its staging buffer. The consumer *reads* (one-sided) the
producer's staged rows into its own, with a notification that reaches the producer when the read is done, so the
producer can free them: vLLM's NixlConnector does the same with device memory. On this machine (no GPU, no RDMA)
UCX moves host memory over TCP; on GPU nodes the same calls move device memory over NVLink or RDMA.

A consumer's reads run on its fetch thread (``pd_fetcher.py``) while a ``kv_both`` instance's engine thread also
reads notifications: one lock serialises the calls into the agent (each one short; a read waits outside it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

import torch

try:  # an optional dependency: only instances started with --kv-transfer-config need it
    from nixl._api import nixl_agent, nixl_agent_config
except ImportError:  # pragma: no cover - checked at start-up with a clear message
    nixl_agent = nixl_agent_config = None

log = logging.getLogger("tokenfab")

RELEASE = b"tokenfab-pd-release "  # notification prefix: the slots a consumer has read


class TransferError(RuntimeError):
    """A read that did not complete (peer gone, timeout, refused descriptors): the caller falls back.
    ``slots_unsafe``: the read may still be writing into the local slots (its handle could not be released)."""

    slots_unsafe: bool = False


class NixlTransport:
    def __init__(self, engine_id: str, listen_port: int, buffer: torch.Tensor, progress_thread: bool) -> None:
        """``progress_thread``: NIXL's own thread that progresses transfers. A producer needs it (over TCP, a
        consumer's read of its memory completes only when the producer's side progresses, and an idle producer
        makes no NIXL calls); it costs about a quarter of a core while idle, so a consumer, whose reads poll
        until done, runs without it."""
        if nixl_agent is None:
            raise ValueError("--kv-transfer-config: kv_connector NixlConnector needs the nixl package "
                             "(pip install nixl)")
        self.name = engine_id
        self.buffer = buffer
        self.slot_nbytes = buffer.shape[1]
        self.base = buffer.data_ptr()
        try:
            self.agent = nixl_agent(engine_id, nixl_agent_config(progress_thread, True, listen_port, backends=["UCX"]))
        except Exception as e:
            raise ValueError(f"--kv-transfer-config: the NIXL agent could not start on port {listen_port}: {e}") \
                from e
        self._reg = self.agent.register_memory(buffer)
        self._lock = threading.Lock()  # one call into the agent at a time (see the module docstring)

    def _descs(self, base: int, slots: Sequence[int]):  # noqa: ANN202 - NIXL's descriptor list type
        n = self.slot_nbytes
        return self.agent.get_xfer_descs([(base + s * n, n, 0) for s in slots], "DRAM")

    def _connect(self, peer: str, host: str, port: int, deadline: float) -> None:
        with self._lock:
            if self.agent.check_remote_metadata(peer):
                return
            self.agent.fetch_remote_metadata(peer, host, port)
            self.agent.send_local_metadata(host, port)
        while True:
            with self._lock:
                if self.agent.check_remote_metadata(peer):
                    return
            if time.monotonic() > deadline:
                raise TransferError(f"no metadata from KV producer {peer} at {host}:{port}")
            time.sleep(0.001)

    def read(self, peer: str, host: str, port: int, remote_base: int, remote_slots: Sequence[int],
             local_slots: Sequence[int], timeout_s: float) -> None:
        """Copy the peer's staged rows ``remote_slots`` into ours ``local_slots``; the peer hears which of its
        slots were read once the data is here. Raises TransferError when it does not complete in time."""
        deadline = time.monotonic() + timeout_s
        handle, state, error = None, None, None
        try:
            self._connect(peer, host, port, deadline)
            notif = RELEASE + ",".join(str(s) for s in remote_slots).encode()
            with self._lock:
                handle = self.agent.initialize_xfer("READ", self._descs(self.base, local_slots),
                                                    self._descs(remote_base, remote_slots), peer, notif)
                state = self.agent.transfer(handle)
            while state != "DONE":
                if state == "ERR":
                    raise TransferError(f"the read from {peer} failed")
                if time.monotonic() > deadline:
                    raise TransferError(f"the read from {peer} timed out after {timeout_s}s")
                time.sleep(0.0002)
                with self._lock:
                    state = self.agent.check_xfer_state(handle)
        except TransferError as e:
            self._forget(peer)
            error = e
            raise
        except Exception as e:  # NIXL raises its own errors for refused descriptors, unknown agents...
            self._forget(peer)
            error = TransferError(f"the read from {peer} failed: {e}")
            raise error from e
        finally:
            if handle is not None:
                try:
                    with self._lock:
                        self.agent.release_xfer_handle(handle)
                except Exception:  # a transfer still in flight cannot be released: NIXL frees it at teardown
                    log.debug("could not release a NIXL transfer handle", exc_info=True)
                    if error is not None and state not in ("DONE", "ERR"):
                        # the peer may still write into local_slots: the caller must not hand them out again
                        error.slots_unsafe = True

    def _forget(self, peer: str) -> None:
        """After a failure: the next read from this peer makes a fresh connection (it may have restarted)."""
        try:
            with self._lock:
                self.agent.remove_remote_agent(peer)
        except Exception:
            log.debug("could not remove NIXL peer %s", peer, exc_info=True)

    def released_slots(self) -> list[int]:
        """Our staged slots that consumers have read since the last call (their notifications)."""
        out: list[int] = []
        with self._lock:
            notifs = self.agent.get_new_notifs()
        for messages in notifs.values():
            for m in messages:
                if m.startswith(RELEASE):
                    out.extend(int(s) for s in m[len(RELEASE):].split(b",") if s)
        return out

    def close(self) -> None:
        try:
            with self._lock:
                self.agent.deregister_memory(self._reg)
        except Exception:
            log.debug("could not deregister the KV transfer buffer", exc_info=True)
