"""Prefill/decode disaggregation as a KV connector (``connector.KVConnector``), speaking vLLM's
``kv_transfer_params`` protocol (what ``vllm-router --vllm-pd-disaggregation`` carries between the two instances).

1. The router sends the request to the producer with ``max_tokens`` 1 and ``kv_transfer_params:
   {"do_remote_decode": true}``. The producer prefills it; when it finishes, ``publish`` copies the prompt's full
   blocks (found by their prefix-cache digests) into pinned staging slots and returns the parameters the answer
   carries: ``{"do_remote_prefill": true, "remote_engine_id", "remote_host", "remote_port", "remote_block_ids"
   (staging slots), "remote_block_hashes" (their digests, hex), "remote_buffer" ([address, bytes per block])}``.
2. The router sends the original request, with those parameters, to the consumer, which parks it (not queued)
   and hands ``fetch`` to its fetch thread (``pd_fetcher.py``): given the prompt's own digests, it keeps the
   leading run the producer's digests agree with and reads those blocks into its own staging (NIXL,
   ``pd_nixl.py``); the producer frees its slots when told the read is done, or after ``pin_timeout_s``. When the
   read is done (or failed), the engine queues the request.
3. The scheduler's admission asks the connector, as it asks any KV tier, for the blocks past the local prefix
   hit: ``lookup``/``load`` copy them from staging into the device cache, and the consumer computes only the
   rest (at least the prompt's last token) and decodes.

Anything that fails in 2 (producer gone, timeout, digests that disagree, blocks of another layout) leaves the
staging without those digests, so step 3 finds nothing and the consumer prefills the prompt itself: a failed
transfer costs time, never the request.

Threads: ``fetch`` runs on the fetch thread, everything else on the engine thread; one lock guards the staging
slots' bookkeeping (the bytes of a slot belong to whoever took or popped it, so copies run outside the lock).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from tokenfab.engine.kv_transfer.block_io import BlockIO
from tokenfab.engine.kv_transfer.connector import KVConnector, KVConnectorStats
from tokenfab.engine.kv_transfer.pd_nixl import NixlTransport, TransferError
from tokenfab.engine.kv_transfer.pd_staging import StagingSlots
from tokenfab.engine.kv_transfer.transfer_config import KVTransferConfig

log = logging.getLogger("tokenfab")

class PDConnector(KVConnector):
    def __init__(self, cfg: KVTransferConfig, io: BlockIO, block_size: int) -> None:
        self.cfg = cfg
        self.io = io
        self.block_size = block_size
        num_slots = int(cfg.kv_buffer_size // io.block_nbytes)
        self.staging = StagingSlots(num_slots, io.block_nbytes)
        self._lock = threading.Lock()  # the staging bookkeeping: the fetch thread and the engine thread
        self.transport = NixlTransport(cfg.engine_id, cfg.kv_port, self.staging.buffer, cfg.is_producer)
        self._stats = KVConnectorStats()
        self.published_blocks = 0  # producer: blocks staged for consumers
        self.fetched_blocks = 0  # consumer: blocks read from producers
        self.failed_fetches = 0  # consumer: reads given up (the request prefills locally)
        log.info("KV transfer (%s, %s): engine %s, NIXL agent on %s:%d, %d staging blocks of %d bytes",
                 cfg.kv_connector, cfg.kv_role, cfg.engine_id, cfg.kv_ip, cfg.kv_port, num_slots, io.block_nbytes)

    # ---- producer -------------------------------------------------------------------------------------
    def publish(self, digests: Sequence[bytes], block_ids: Sequence[int]) -> dict[str, Any]:
        """Stage device blocks ``block_ids`` (named ``digests``) for a consumer; the answer's kv_transfer_params.
        With no free staging slot the parameters name no block (the consumer prefills it all)."""
        self.poll()
        with self._lock:
            slots = self.staging.take(len(block_ids), self.cfg.pin_timeout_s) if block_ids else []
        if slots is None:
            log.warning("KV transfer: staging full (%d pinned): a prompt's %d blocks are not handed over",
                        self.staging.num_pinned, len(block_ids))
            slots, digests = [], []
        if slots:
            self.staging.buffer[slots] = self.io.read(block_ids)
            self.published_blocks += len(slots)
        return {
            "do_remote_prefill": True, "do_remote_decode": False,
            "remote_engine_id": self.cfg.engine_id, "remote_host": self.cfg.kv_ip, "remote_port": self.cfg.kv_port,
            "remote_block_ids": list(slots), "remote_block_hashes": [d.hex() for d in digests],
            "remote_buffer": [self.staging.buffer.data_ptr(), self.io.block_nbytes],
        }

    def poll(self) -> None:
        """Free the staged slots consumers have read (their notifications)."""
        released = self.transport.released_slots()
        if released:
            with self._lock:
                self.staging.release(released)

    # ---- consumer -------------------------------------------------------------------------------------
    def fetch(self, params: dict[str, Any], digests: Sequence[bytes]) -> int:
        """Read the producer's blocks for a prompt whose own leading digests are ``digests``: the leading run the
        producer staged under the same digests. Returns the blocks now held; 0 on any failure (logged). Runs on
        the fetch thread (``pd_fetcher.py``); the engine thread may call anything else meanwhile."""
        remote = [bytes.fromhex(h) for h in params["remote_block_hashes"]]
        n = 0
        while n < min(len(remote), len(digests)) and remote[n] == digests[n]:
            n += 1
        if n == 0:
            return 0
        base, nbytes = params["remote_buffer"]
        if nbytes != self.io.block_nbytes:
            self.failed_fetches += 1
            log.warning("KV transfer: the producer's blocks are %d bytes, ours %d (another model or layout): "
                        "prefilling locally", nbytes, self.io.block_nbytes)
            return 0
        with self._lock:
            slots = self.staging.take(n, self.cfg.transfer_timeout_s, evict_held=True)
        if slots is None:
            self.failed_fetches += 1
            log.warning("KV transfer: no staging room for %d blocks: prefilling locally", n)
            return 0
        try:
            self.transport.read(params["remote_engine_id"], params["remote_host"], params["remote_port"], base,
                                params["remote_block_ids"][:n], slots, self.cfg.transfer_timeout_s)
        except TransferError as e:
            if e.slots_unsafe:  # a stale write may still land there: the slots stay out of use (logged)
                with self._lock:
                    self.staging.retire(slots)
                log.warning("KV transfer: %d staging slots left out of use (a read still in flight)", len(slots))
            else:
                with self._lock:
                    self.staging.release(slots)
            self.failed_fetches += 1
            log.warning("KV transfer failed (%s): prefilling locally", e)
            return 0
        with self._lock:
            self.staging.hold(digests[:n], slots)
            self.fetched_blocks += n
        return n

    def drop(self, digests: Sequence[bytes]) -> None:
        """Give up the held blocks of ``digests`` (a parked request aborted after its read finished)."""
        with self._lock:
            self.staging.free(self.staging.pop(digests))

    def lookup(self, digests: Sequence[bytes]) -> int:
        with self._lock:
            n = self.staging.lookup(digests)
        self._stats.lookup_blocks += len(digests)
        self._stats.lookup_hit_blocks += n
        return n

    def load(self, digests: Sequence[bytes], block_ids: Sequence[int]) -> int:
        if len(digests) != len(block_ids):
            raise ValueError(f"{len(digests)} digests for {len(block_ids)} blocks")
        with self._lock:
            slots = self.staging.pop(digests)  # ours until freed: the copy runs outside the lock
        if slots:
            try:
                start = 0  # runs of consecutive slots, each written from a view of the buffer (no gathered copy)
                for i in range(1, len(slots) + 1):
                    if i == len(slots) or slots[i] != slots[i - 1] + 1:
                        self.io.write(block_ids[start:i], self.staging.buffer[slots[start]:slots[i - 1] + 1])
                        start = i
            finally:
                with self._lock:
                    self.staging.free(slots)
        self._stats.loaded_blocks += len(slots)
        self._stats.load_failed_blocks += len(digests) - len(slots)
        return len(slots)

    def save(self, digests: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """Evicted blocks: not this connector's business (the producer stages finished prompts in ``publish``)."""

    def clear(self) -> None:
        with self._lock:
            self.staging.clear()

    def stats(self) -> KVConnectorStats:
        s = KVConnectorStats(**vars(self._stats))
        with self._lock:
            s.host_blocks = self.staging.num_held + self.staging.num_pinned
        s.host_bytes = s.host_blocks * self.io.block_nbytes
        s.saved_blocks = self.published_blocks
        return s

    def close(self) -> None:
        self.transport.close()
