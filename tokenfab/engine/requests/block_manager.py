"""The paged KV cache's block manager, with prefix caching.

Blocks hold ``block_size`` tokens. A full block is identified by a digest chained over the
whole prefix up to and including it (BLAKE2b-128 of the parent's digest and the block's token
bytes), so equal blocks at different prefixes never match, and nobody can compute a collision
(Python's ``hash()`` of ints is unsalted: colliding prompts can be found offline, and a collision
would serve one user another user's KV). A request's ``cache_salt`` is mixed into the first
block's digest only: requests with different salts never share a block, equal salts do.

Every block has a reference count; a block whose count drops to zero goes to the free queue
but keeps its digest, so a later request with the same prefix can take it back (a prefix-cache
hit) until its memory is needed: allocation takes the least recently freed block first (LRU)
and only then forgets its digest.

Listeners (``event_listeners``) hear what the prefix cache gains and loses, in vLLM's KV-event shapes
(``kv_events.py``): blocks stored when their digest is registered, removed when it is forgotten, all cleared on a
reset. The ZeroMQ publisher for ``--kv-events-config`` is one; with none, nothing is built.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence as Seq

from tokenfab.engine.kv_transfer.connector import KVConnector
from tokenfab.engine.requests.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventListener,
)
from tokenfab.engine.requests.sequence import Sequence
from tokenfab.engine.requests.state_slots import StateSlots
from tokenfab.engine.requests.state_snapshots import StateSnapshots

_DIGEST_SIZE = 16  # 128 bits: collisions need ~2**64 work


def root_digest(cache_salt: str | None = None, lora_int_id: int = 0) -> bytes:
    """The "parent" of a sequence's first block: a constant, or a digest of the salt and the LoRA
    adapter's id (fixed width, before the salt: no salt can spell another adapter's root)."""
    h = hashlib.blake2b(b"tokenfab-prefix-cache-root", digest_size=_DIGEST_SIZE)
    if lora_int_id:
        h.update(b"\x00lora\x00" + lora_int_id.to_bytes(8, "little"))
    if cache_salt is not None:
        h.update(b"\x00salt\x00")
        h.update(cache_salt.encode("utf-8", "surrogatepass"))
    return h.digest()


_ROOT = root_digest()


def hash_block(parent: bytes, tokens: Seq[int]) -> bytes:
    """BLAKE2b-128 over the parent's digest and the block's tokens as int32 bytes (fixed width: no
    two token lists share an encoding). Stable across processes, unlike ``hash()``."""
    h = hashlib.blake2b(parent, digest_size=_DIGEST_SIZE)
    h.update(array("i", tokens).tobytes())
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 state_slots: StateSlots | None = None) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # digest -> block id
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # counters
        self.prefix_queries = 0  # prompt tokens looked up in the cache
        self.prefix_hits = 0  # of which found
        self.event_listeners: list[KVEventListener] = []
        # a KV tier beyond the device (engine/kv_transfer, --kv-offload-bytes): evicted blocks are saved to it
        # before their digests are forgotten, and a new sequence's prefix goes on there where the local hit ends.
        # Counters in prompt tokens, as vLLM's external_prefix_cache_queries / _hits
        self.connector: KVConnector | None = None
        self.connector_queries = 0
        self.connector_hits = 0
        self._evicted: list[tuple[bytes, int]] = []  # (digest, block) forgotten by _pop_free, not saved yet
        # hybrid cache: per-sequence recurrent-state slots, taken with a sequence's first blocks and
        # given back with its blocks (None: the model keeps no recurrent state)
        self.state_slots = state_slots
        # hybrid prefix caching: recurrent-state snapshots at block boundaries (None: a hybrid model runs
        # without prefix caching; requests/state_snapshots.py)
        self.state_snapshots: StateSnapshots | None = None

    def _emit(self, event: KVCacheEvent) -> None:
        for listener in self.event_listeners:
            listener(event)

    # ---- capacity -------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        total = seq.num_computed_tokens + num_new_tokens
        return max(0, -(-total // self.block_size) - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        if self.state_slots is not None and not self.state_slots.can_allocate(seq):
            return False
        return self.blocks_needed(seq, num_new_tokens) <= self.num_free_blocks

    # ---- prefix cache ---------------------------------------------------------------
    def _full_block_hashes(self, seq: Sequence, upto_tokens: int) -> list[bytes]:
        """seq.block_hashes, extended in place to the full blocks within its first ``upto_tokens``
        tokens (a block's digest depends only on tokens, which never change once known)."""
        bs = self.block_size
        hashes = seq.block_hashes
        if hashes:
            parent = hashes[-1]
        else:
            lora = seq.lora_request.lora_int_id if seq.lora_request is not None else 0
            parent = _ROOT if seq.cache_salt is None and not lora else root_digest(seq.cache_salt, lora)
        for i in range(len(hashes), upto_tokens // bs):
            parent = hash_block(parent, seq.token_ids[i * bs : (i + 1) * bs])
            hashes.append(parent)
        return hashes

    def allocate_cached_prefix(self, seq: Sequence) -> int:
        """For a sequence with no blocks yet: take every cached block of its known tokens'
        prefix (at least one token is left to compute, for the logits). Returns tokens hit."""
        assert not seq.block_table and seq.num_computed_tokens == 0
        if not self.enable_prefix_caching:
            return 0
        if seq.prompt_logprobs is not None and len(seq.prompt_logprobs) < seq.num_prompt_tokens:
            # a cached block has no logits: a request that scores its prompt computes all of it
            self.prefix_queries += seq.num_tokens
            return 0
        hashes = self._full_block_hashes(seq, seq.num_tokens - 1)
        hit = 0
        for h in hashes:
            block = self.cached.get(h)
            if block is None:
                break
            self._take(block)
            seq.block_table.append(block)
            hit += 1
        if self.state_snapshots is not None:
            hit = self._snapshot_hit(seq, hashes, hit)
        local = hit
        if self.connector is not None and hit < len(hashes) and self.state_snapshots is None:
            self.connector_queries += (len(hashes) - hit) * self.block_size
            hit += self._load_from_connector(seq, hashes, hit)
            self.connector_hits += (hit - local) * self.block_size
        seq.num_computed_tokens = hit * self.block_size
        seq.num_committed_blocks = hit
        self.prefix_queries += seq.num_tokens
        self.prefix_hits += local * self.block_size
        return seq.num_computed_tokens

    def _snapshot_hit(self, seq: Sequence, hashes: list[bytes], hit: int) -> int:
        """Hybrid models: the hit cut back to its longest prefix whose last block has a recurrent-state
        snapshot, the blocks past it given back; the snapshot's row goes to ``seq.state_restore_row``. When
        blocks were given back, the end of the cached prefix (where this prompt parts from an earlier one)
        goes to ``seq.state_cut_at``: a chunk ends there, so a snapshot is saved there for the next one."""
        keep, row = hit, None
        while keep and row is None:
            row = self.state_snapshots.lookup(hashes[keep - 1])
            if row is None:
                keep -= 1
        for block in reversed(seq.block_table[keep:]):
            self.ref_counts[block] -= 1
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
        del seq.block_table[keep:]
        seq.state_cut_at = hit * self.block_size if keep < hit else 0
        if row is not None:
            seq.state_restore_row = row
            self.state_snapshots.restored += 1
        return keep

    def align_chunk(self, seq: Sequence, n: int) -> int:
        """``n`` new tokens, cut to end on a block boundary under hybrid prefix caching (else ``n``), and to the
        sequence's ``max_prefill_chunk`` when set."""
        if seq.max_prefill_chunk is not None:
            n = min(n, seq.max_prefill_chunk)
        if self.state_snapshots is None:
            return n
        return self.state_snapshots.align_chunk(seq.num_computed_tokens, n, seq.num_tokens, self.block_size,
                                                seq.state_cut_at)

    def commit_full_blocks(self, seq: Sequence) -> None:
        """Register the hashes of blocks that became full with computed tokens."""
        if not self.enable_prefix_caching:
            return
        n_full = seq.num_computed_tokens // self.block_size
        if n_full <= seq.num_committed_blocks:
            return
        hashes = self._full_block_hashes(seq, n_full * self.block_size)
        stored: list[int] = []  # indices of the blocks registered now (for the listeners)
        for i in range(seq.num_committed_blocks, n_full):  # only the blocks filled since last time
            block, h = seq.block_table[i], hashes[i]
            if self.block_hash[block] is None and h not in self.cached:
                self.block_hash[block] = h
                self.cached[h] = block
                stored.append(i)
        seq.num_committed_blocks = n_full
        if stored and self.event_listeners:
            self._emit_stored(seq, hashes, stored)

    def _emit_stored(self, seq: Sequence, hashes: list[bytes], stored: list[int]) -> None:
        """One BlockStored per run of consecutive registered blocks (vLLM chains a run to its parent)."""
        bs = self.block_size
        lora = seq.lora_request.lora_int_id if seq.lora_request is not None else None
        runs: list[list[int]] = []
        for i in stored:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            self._emit(BlockStored([hashes[i] for i in run], hashes[first - 1] if first else None,
                                   list(seq.token_ids[first * bs:(last + 1) * bs]), bs, lora))

    # ---- allocation -----------------------------------------------------------------
    def _take(self, block: int) -> None:
        if self.ref_counts[block] == 0:
            del self.free_queue[block]
        self.ref_counts[block] += 1

    def _pop_free(self) -> int:
        block, _ = self.free_queue.popitem(last=False)  # least recently freed first
        h = self.block_hash[block]
        if h is not None:
            if self.cached.get(h) == block:
                del self.cached[h]
                if self.connector is not None:
                    self._evicted.append((h, block))
                if self.event_listeners:
                    self._emit(BlockRemoved([h]))
            self.block_hash[block] = None
        self.ref_counts[block] = 1
        return block

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Give seq enough blocks for ``num_new_tokens`` more computed tokens (and a state slot if it
        has none and the model keeps recurrent state); False, nothing taken, if short."""
        need = self.blocks_needed(seq, num_new_tokens)
        if need > self.num_free_blocks:
            return False
        if self.state_slots is not None and not self.state_slots.allocate(seq):
            return False  # no slot free: admission waits, as for blocks
        for _ in range(need):
            seq.block_table.append(self._pop_free())
        self._save_evicted()
        return True

    # ---- the KV tier beyond the device (connector) -----------------------------------
    def _save_evicted(self) -> None:
        """Hand the blocks evicted since the last call to the connector. Called before anything can write to
        them: they were just taken for this schedule step, whose forward runs later."""
        if self._evicted:
            evicted, self._evicted = self._evicted, []
            self.connector.save([h for h, _ in evicted], [b for _, b in evicted])

    def _load_from_connector(self, seq: Sequence, hashes: list[bytes], start: int) -> int:
        """Extend seq's prefix hit from the connector: the leading run of ``hashes[start:]`` it holds, as far as
        free blocks allow (blocks of the run still cached here are taken, not loaded). Loaded blocks join the
        prefix cache. Returns the blocks added to seq's block table."""
        run = hashes[start:start + self.connector.lookup(hashes[start:])]
        local = [self.cached.get(h) for h in run]
        free = self.num_free_blocks - sum(1 for b in local if b is not None and self.ref_counts[b] == 0)
        keep = missing = 0
        for b in local:
            if b is None:
                if missing == free:
                    break
                missing += 1
            keep += 1
        run, local = run[:keep], local[:keep]
        for b in local:  # first, so that taking blocks for the loads cannot evict them
            if b is not None:
                self._take(b)
        blocks = [b if b is not None else self._pop_free() for b in local]
        self._save_evicted()  # before the loads overwrite them
        wanted = [i for i, b in enumerate(local) if b is None]
        loaded = self.connector.load([run[i] for i in wanted], [blocks[i] for i in wanted]) if wanted else 0
        cut = wanted[loaded] if loaded < len(wanted) else len(run)  # the chain breaks at the first failed load
        for b in reversed(blocks[cut:]):  # give back what lies beyond it
            self.ref_counts[b] -= 1
            if self.ref_counts[b] == 0:
                self.free_queue[b] = None
                if self.block_hash[b] is None:
                    self.free_queue.move_to_end(b, last=False)  # empty: the first to be reused
        stored = []
        for i in wanted[:loaded]:
            self.block_hash[blocks[i]] = run[i]
            self.cached[run[i]] = blocks[i]
            stored.append(start + i)
        seq.block_table.extend(blocks[:cut])
        if stored and self.event_listeners:
            self._emit_stored(seq, hashes, stored)
        return cut

    def trim(self, seq: Sequence) -> None:
        """Free the tail blocks beyond those holding seq's computed tokens (speculative decoding:
        blocks allocated for draft tokens that were rejected). Such blocks were freshly allocated
        for this step, so they are unshared and carry no prefix-cache digest."""
        keep = -(-seq.num_computed_tokens // self.block_size)
        while len(seq.block_table) > keep:
            block = seq.block_table.pop()
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None

    def free(self, seq: Sequence) -> None:
        """Drop seq's references. Tail blocks go first in the free queue: they are the least
        likely to be shared, so they are the first evicted."""
        for block in reversed(seq.block_table):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self.free_queue[block] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_committed_blocks = 0
        if self.state_slots is not None:
            self.state_slots.free(seq)
            seq.state_restore_row = -1
            seq.state_cut_at = 0

    def reset_prefix_cache(self) -> None:
        if self.connector is not None:
            self.connector.clear()
        for block in list(self.cached.values()):
            self.block_hash[block] = None
        self.cached.clear()
        if self.state_snapshots is not None:
            self.state_snapshots.clear()
        self._emit(AllBlocksCleared())

    def check_invariants(self) -> None:
        """Assert the internal bookkeeping is consistent (tests and debugging)."""
        assert len(self.free_queue) == sum(1 for r in self.ref_counts if r == 0)
        for b in self.free_queue:
            assert self.ref_counts[b] == 0
        for h, b in self.cached.items():
            assert self.block_hash[b] == h
        assert all(r >= 0 for r in self.ref_counts)
        if self.state_slots is not None:
            self.state_slots.check_invariants()
