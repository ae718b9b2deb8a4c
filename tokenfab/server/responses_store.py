"""The in-memory store of responses, for ``previous_response_id`` and ``GET /v1/responses/{id}``.

Bounded three ways, so that no client can grow it without limit: at most ``max_entries`` responses (the least
recently used goes first), at most ``max_bytes`` of stored text in all, and each entry expires ``ttl`` seconds
after it was stored. It lives in the API-server process: with ``--api-server-count N`` each process has its
own, and a restart forgets everything (OpenAI keeps responses for 30 days; a local server cannot promise that).
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_STORE_SIZE = 1024
DEFAULT_TTL_S = 3600.0
DEFAULT_MAX_BYTES = 256 << 20


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object as returned
    messages: list[dict[str, Any]]  # the conversation so far, as chat messages (input + output, no instructions)
    expires: float
    size: int
    input_items: list[dict[str, Any]] = field(default_factory=list)  # this request's input, as listed by the API


class ResponseStore:
    """LRU + TTL map from response id to ``StoredResponse``; ``clock`` is injectable for tests."""

    def __init__(self, max_entries: int = DEFAULT_STORE_SIZE, ttl: float = DEFAULT_TTL_S,
                 max_bytes: int = DEFAULT_MAX_BYTES, clock: Callable[[], float] = time.monotonic) -> None:
        if max_entries < 0:
            raise ValueError("max_entries must be >= 0 (0: store nothing)")
        if not ttl > 0:
            raise ValueError("ttl must be > 0 seconds")
        self.max_entries = max_entries
        self.ttl = ttl
        self.max_bytes = max_bytes
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        self._expire()
        return len(self._entries)

    def put(self, response_id: str, response: dict[str, Any], messages: list[dict[str, Any]],
            input_items: list[dict[str, Any]] | None = None) -> bool:
        """Store (replacing an entry of the same id); False if it cannot be kept (store size 0, or larger than
        the whole byte budget)."""
        input_items = input_items or []
        size = sum(len(json.dumps(x, ensure_ascii=False)) for x in (response, messages, input_items))
        self.delete(response_id)
        if self.max_entries == 0 or size > self.max_bytes:
            return False
        self._expire()
        self._entries[response_id] = StoredResponse(response, messages, self._clock() + self.ttl, size, input_items)
        self._bytes += size
        while len(self._entries) > self.max_entries or self._bytes > self.max_bytes:
            self._pop_oldest()
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        """The entry, or None if unknown or expired; a hit counts as a use (LRU), not as a refresh of its TTL."""
        entry = self._entries.get(response_id)
        if entry is None:
            return None
        if entry.expires <= self._clock():
            self.delete(response_id)
            return None
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return False
        self._bytes -= entry.size
        return True

    def _pop_oldest(self) -> None:
        _, entry = self._entries.popitem(last=False)
        self._bytes -= entry.size

    def _expire(self) -> None:
        """Drop expired entries. Insertion order is expiry order only until a get moves an entry to the end, so
        scan them all; cheap next to the request that calls it (at most ``max_entries`` comparisons)."""
        now = self._clock()
        for key in [k for k, e in self._entries.items() if e.expires <= now]:
            self.delete(key)
