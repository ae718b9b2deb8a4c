"""A two-level LRU store of KV block payloads beyond the device: host memory first, then local disk.

Entries are ``uint8`` CPU tensors (one block's bytes, ``block_io.BlockIO``) keyed by the prefix cache's
digest. ``put`` inserts into host memory as the most recently used; when host memory is over its byte bound
its least recently used entries spill to disk (or are dropped when there is no disk level), and when the disk
is over its byte bound its least recently used files are removed. ``lookup`` and ``get`` make entries the
most recently used; ``get`` on a disk entry reads it back into host memory and removes the file (unless the
entry is larger than host memory altogether: then the file stays).

Files live in a directory of their own, made under ``disk_dir`` for this store (``tokenfab-kv-*``) and removed
with everything in it by ``close()`` (or at interpreter exit): a store's files are only ever read by the
engine that wrote them, which holds the same model, cache layout and FP8 scales. Each file starts with a
header (magic, the digest, the payload length, a BLAKE2b checksum of the payload): a file that is missing,
short, renamed or altered is a miss (the entry is forgotten and the file removed), never an exception.
Writes go to a temporary name and are renamed into place, so a crash never leaves a half file under a
valid name.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import struct
import tempfile
import weakref
from collections import OrderedDict
from collections.abc import Sequence

import torch

log = logging.getLogger("tokenfab")

_MAGIC = b"TFKV\x01"
_HEADER = struct.Struct("<5s16sQ16s")  # magic, digest, payload bytes, blake2b-128 of the payload


def _checksum(data: bytes | memoryview) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


class KVTierStore:
    def __init__(self, host_bytes: int, disk_dir: str | None = None, disk_bytes: int = 0) -> None:
        if host_bytes < 0 or disk_bytes < 0:
            raise ValueError(f"tier sizes must be >= 0, got host {host_bytes}, disk {disk_bytes}")
        self.host_limit = host_bytes
        self.disk_limit = disk_bytes if disk_dir is not None else 0
        self.host: OrderedDict[bytes, torch.Tensor] = OrderedDict()  # digest -> payload, least recent first
        self.disk: OrderedDict[bytes, int] = OrderedDict()  # digest -> payload bytes, least recent first
        self.host_bytes = 0
        self.disk_bytes = 0
        self.spilled = 0  # entries moved host -> disk
        self.dropped = 0  # entries forgotten for good
        self.bad_files = 0  # disk entries found missing or corrupt
        self.dir: str | None = None
        if disk_dir is not None and self.disk_limit > 0:
            os.makedirs(disk_dir, exist_ok=True)
            self.dir = tempfile.mkdtemp(prefix="tokenfab-kv-", dir=disk_dir)
            self._cleanup = weakref.finalize(self, shutil.rmtree, self.dir, True)

    # ---- queries --------------------------------------------------------------------
    def __contains__(self, digest: bytes) -> bool:
        return digest in self.host or digest in self.disk

    def __len__(self) -> int:
        return len(self.host) + len(self.disk)

    def lookup(self, digests: Sequence[bytes]) -> int:
        """How many leading digests are held. Those become the most recently used, the chain's head last (the
        most recent of all): evicting from the tail first keeps what is left of a chain useful."""
        n = 0
        while n < len(digests) and digests[n] in self:
            n += 1
        for d in reversed(digests[:n]):
            if d in self.host:
                self.host.move_to_end(d)
            else:
                self.disk.move_to_end(d)
        return n

    def get(self, digest: bytes) -> torch.Tensor | None:
        """The payload, or None (not held, or its file missing or corrupt: then forgotten)."""
        payload = self.host.get(digest)
        if payload is not None:
            self.host.move_to_end(digest)
            return payload
        if digest not in self.disk:
            return None
        size = self.disk[digest]
        payload = self._read_file(digest, size)
        if payload is None or size <= self.host_limit:  # corrupt: forgotten; else recently used: back to memory
            del self.disk[digest]
            self.disk_bytes -= size
            self._remove_file(digest)
            if payload is None:
                self.bad_files += 1
                self.dropped += 1
                return None
            self._insert_host(digest, payload)
        else:  # no room in memory at all (disk only): the file stays, the most recent on disk
            self.disk.move_to_end(digest)
        return payload

    # ---- updates --------------------------------------------------------------------
    def put(self, digest: bytes, payload: torch.Tensor) -> None:
        """Hold ``payload`` (a CPU uint8 tensor, kept as given) under ``digest``; held already: just touched."""
        if self.lookup([digest]):
            return
        self._insert_host(digest, payload)

    def clear(self) -> None:
        for d in list(self.disk):
            self._remove_file(d)
        self.host.clear()
        self.disk.clear()
        self.host_bytes = self.disk_bytes = 0

    def close(self) -> None:
        self.clear()
        if self.dir is not None:
            self._cleanup()

    def _insert_host(self, digest: bytes, payload: torch.Tensor) -> None:
        size = payload.numel()
        if size > self.host_limit:  # larger than host memory altogether: straight to disk
            self._spill(digest, payload)
            return
        self.host[digest] = payload
        self.host_bytes += size
        while self.host_bytes > self.host_limit:
            d, p = self.host.popitem(last=False)
            self.host_bytes -= p.numel()
            self._spill(d, p)

    def _spill(self, digest: bytes, payload: torch.Tensor) -> None:
        size = payload.numel()
        if self.dir is None or size > self.disk_limit:
            self.dropped += 1
            return
        while self.disk_bytes + size > self.disk_limit:
            d, s = self.disk.popitem(last=False)
            self.disk_bytes -= s
            self._remove_file(d)
            self.dropped += 1
        if not self._write_file(digest, payload):
            self.dropped += 1
            return
        self.disk[digest] = size
        self.disk_bytes += size
        self.spilled += 1

    # ---- files ----------------------------------------------------------------------
    def path(self, digest: bytes) -> str:
        assert self.dir is not None
        return os.path.join(self.dir, digest.hex() + ".kv")

    def _write_file(self, digest: bytes, payload: torch.Tensor) -> bool:
        data = payload.contiguous().numpy().tobytes()
        path = self.path(digest)
        tmp = path + ".tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(_HEADER.pack(_MAGIC, digest, len(data), _checksum(data)))
                f.write(data)
            os.replace(tmp, path)
            return True
        except OSError as e:  # disk full, directory removed: the entry is dropped, the engine goes on
            log.warning("KV tier: could not write %s (%s); block dropped", path, e)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False

    def _read_file(self, digest: bytes, size: int) -> torch.Tensor | None:
        path = self.path(digest)
        try:
            with open(path, "rb") as f:
                header = f.read(_HEADER.size)
                data = f.read(size + 1)
        except OSError:
            return None
        if len(header) != _HEADER.size or len(data) != size:
            return None
        magic, file_digest, length, checksum = _HEADER.unpack(header)
        if magic != _MAGIC or file_digest != digest or length != size or _checksum(data) != checksum:
            return None
        return torch.frombuffer(bytearray(data), dtype=torch.uint8)

    def _remove_file(self, digest: bytes) -> None:
        try:
            os.unlink(self.path(digest))
        except OSError:
            pass
