"""The KV tier's store (engine/kv_transfer/tier.py) and block copies (block_io.py): LRU order across host
memory and disk, byte bounds, spill and reload, files removed, a missing or corrupt file a miss; blocks of every
cache layout and dtype copied out and back bit for bit."""

from __future__ import annotations

import os

import pytest
import torch

from tokenfab.engine.kv_transfer.block_io import BlockIO
from tokenfab.engine.kv_transfer.sizes import gib_to_bytes, parse_bytes
from tokenfab.engine.kv_transfer.tier import KVTierStore

B = 64  # payload bytes per entry in these tests


def key(i: int) -> bytes:
    return i.to_bytes(16, "little")


def payload(i: int) -> torch.Tensor:
    return torch.full((B,), i % 256, dtype=torch.uint8)


def files(store: KVTierStore) -> set[str]:
    return {f for f in os.listdir(store.dir) if not f.endswith(".tmp")}


def test_host_only_lru_order_and_byte_bound():
    s = KVTierStore(host_bytes=3 * B)
    for i in range(3):
        s.put(key(i), payload(i))
    assert s.lookup([key(0)]) == 1  # 0 becomes the most recent: 1 is now the least recent
    s.put(key(3), payload(3))
    assert key(1) not in s and {key(0), key(2), key(3)} <= set(s.host)
    assert s.host_bytes == 3 * B and s.dropped == 1  # no disk: dropped for good
    assert torch.equal(s.get(key(2)), payload(2))
    assert s.get(key(1)) is None


def test_lookup_counts_the_leading_run_and_keeps_the_chain_head_longest():
    s = KVTierStore(host_bytes=4 * B)
    for i in (0, 1, 2, 9):
        s.put(key(i), payload(i))
    assert s.lookup([key(0), key(1), key(5), key(2)]) == 2
    assert s.lookup([key(5), key(0)]) == 0
    assert s.lookup([key(0), key(1), key(2)]) == 3
    assert list(s.host)[-3:] == [key(2), key(1), key(0)]  # the head is the most recent
    s.put(key(7), payload(7))  # evicts 9 (untouched), then the chain's tail first
    s.put(key(8), payload(8))
    assert key(9) not in s and key(2) not in s and key(0) in s and key(1) in s


def test_spill_to_disk_then_reload_and_disk_bound(tmp_path):
    s = KVTierStore(host_bytes=2 * B, disk_dir=str(tmp_path), disk_bytes=3 * B)
    assert os.path.dirname(s.dir) == str(tmp_path)
    for i in range(5):
        s.put(key(i), payload(i))
    assert set(s.host) == {key(3), key(4)}
    assert set(s.disk) == {key(0), key(1), key(2)} and s.disk_bytes == 3 * B and s.spilled == 3
    assert files(s) == {key(i).hex() + ".kv" for i in range(3)}
    s.put(key(5), payload(5))  # 3 spills; the disk is full: its least recent file (0) goes
    assert key(0) not in s and s.dropped == 1 and files(s) == {key(i).hex() + ".kv" for i in (1, 2, 3)}
    got = s.get(key(1))  # read back from disk into memory; its file removed
    assert torch.equal(got, payload(1)) and key(1) in s.host
    assert key(1).hex() + ".kv" not in files(s)
    assert s.host_bytes <= 2 * B and s.disk_bytes <= 3 * B
    assert sum(1 for _ in s.disk) == len(files(s))


def test_entry_larger_than_host_memory_goes_straight_to_disk(tmp_path):
    s = KVTierStore(host_bytes=0, disk_dir=str(tmp_path), disk_bytes=10 * B)
    s.put(key(1), payload(1))
    assert not s.host and key(1) in s.disk
    assert torch.equal(s.get(key(1)), payload(1))
    assert key(1) in s.disk and os.path.exists(s.path(key(1))) and s.spilled == 1  # read in place, not rewritten


@pytest.mark.parametrize("damage", ["missing", "truncated", "flipped", "swapped"])
def test_a_missing_or_corrupt_file_is_a_miss(tmp_path, damage):
    s = KVTierStore(host_bytes=0, disk_dir=str(tmp_path), disk_bytes=10 * B)
    s.put(key(1), payload(1))
    s.put(key(2), payload(2))
    path = s.path(key(1))
    if damage == "missing":
        os.unlink(path)
    elif damage == "truncated":
        with open(path, "r+b") as f:
            f.truncate(os.path.getsize(path) - 1)
    elif damage == "flipped":
        data = bytearray(open(path, "rb").read())
        data[-1] ^= 1
        open(path, "wb").write(bytes(data))
    else:  # another entry's (valid) file under this name
        os.replace(s.path(key(2)), path)
    assert s.lookup([key(1)]) == 1  # the index still says held ...
    assert s.get(key(1)) is None  # ... but the read is a miss, and the entry is forgotten
    assert key(1) not in s and s.bad_files == 1
    assert not os.path.exists(path)


def test_clear_and_close_remove_the_files(tmp_path):
    s = KVTierStore(host_bytes=B, disk_dir=str(tmp_path), disk_bytes=10 * B)
    for i in range(4):
        s.put(key(i), payload(i))
    assert len(files(s)) == 3
    s.clear()
    assert len(s) == 0 and files(s) == set() and s.disk_bytes == 0
    s.put(key(0), payload(0))
    s.put(key(1), payload(1))
    d = s.dir
    s.close()
    assert not os.path.exists(d) and os.listdir(tmp_path) == []


def test_sizes():
    assert parse_bytes("4GiB") == 4 * 1024**3 and parse_bytes("512MB") == 512 * 10**6
    assert parse_bytes("1000") == 1000 and parse_bytes("1.5k") == 1500 and gib_to_bytes("0.5") == 2**29
    for bad in ("", "-1", "4 parsecs", "GiB"):
        with pytest.raises(ValueError):
            parse_bytes(bad)


def _fill(t: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(t.shape, generator=g).to(t.dtype)


@pytest.mark.parametrize("layout", ["attention", "latent"])
def test_block_io_round_trips_every_dtype_bit_for_bit(layout):
    nb, bs = 6, 4
    if layout == "attention":  # [L, 2, NB, bs, Hkv, D], one tensor per cache dtype (FP8 layers beside bf16)
        shapes, axis = [(3, 2, nb, bs, 2, 8), (1, 2, nb, bs, 2, 8)], 2
    else:  # MLA: [L, NB, bs, latent + rope]
        shapes, axis = [(2, nb, bs, 24), (1, nb, bs, 24)], 1
    dtypes = [torch.bfloat16, torch.float8_e4m3fn]
    caches = [_fill(torch.empty(s, dtype=d), i) for i, (s, d) in enumerate(zip(shapes, dtypes))]
    io = BlockIO([(c, axis) for c in caches], nb)
    per_block = sum(c.numel() // nb * c.element_size() for c in caches)
    assert io.block_nbytes == per_block
    before = [c.clone() for c in caches]
    rows = io.read([4, 1])
    assert rows.dtype == torch.uint8 and tuple(rows.shape) == (2, per_block)
    for c in caches:  # scribble over the blocks, then write them back in the other order's slots
        c.select(axis, 4).zero_()
    io.write([1, 4], rows.flip(0))
    for c, b in zip(caches, before):
        for blk in range(nb):
            got, want = c.select(axis, blk).view(torch.uint8), b.select(axis, blk).view(torch.uint8)
            assert torch.equal(got, want), blk  # every block as it was: 1 and 4 swapped back into place
    io.write([0], io.read([5]))  # a single block copied over another
    for c in caches:
        assert torch.equal(c.select(axis, 0).view(torch.uint8), c.select(axis, 5).view(torch.uint8))


def test_block_io_refuses_bad_input():
    cache = torch.zeros(1, 2, 3, 4, 1, 2)
    io = BlockIO([(cache, 2)], 3)
    with pytest.raises(IndexError):
        io.read([3])
    with pytest.raises(ValueError):
        io.write([0], torch.zeros(1, io.block_nbytes + 1, dtype=torch.uint8))
    with pytest.raises(ValueError):
        BlockIO([(cache, 1)], 3)  # axis 1 has 2 entries, not 3 blocks
