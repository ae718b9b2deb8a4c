"""Prefill/decode disaggregation's transfer, without a model: the --kv-transfer-config parser, the staging slots,
NIXL moving KV blocks between two processes (a producer process over a random cache, the consumer here),
including a producer that is gone (the read gives up, nothing is held: the consumer would prefill), and the
consumer's fetch thread (order, cancellation, a read that raises, shutdown). The engine's parking of decode legs
is ``test_pd_parking.py``."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import threading
import time

import pytest
import torch

from tokenfab.engine.args import EngineArgs
from tokenfab.engine.kv_transfer.block_io import BlockIO
from tokenfab.engine.kv_transfer.pd_connector import PDConnector
from tokenfab.engine.kv_transfer.pd_fetcher import BackgroundFetcher, FetchJob
from tokenfab.engine.kv_transfer.pd_params import check_params
from tokenfab.engine.kv_transfer.pd_staging import StagingSlots
from tokenfab.engine.kv_transfer.transfer_config import KVTransferConfig

SHAPE = (3, 2, 8, 4, 2, 8)  # [layers, k/v, blocks, block size, heads, head dim]: the runner's attention layout


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cfg(role: str, **extra: object) -> KVTransferConfig:
    io_bytes = 3 * 2 * 4 * 2 * 8 * 4  # one block of SHAPE, float32
    return KVTransferConfig.parse({"kv_connector": "NixlConnector", "kv_role": role, "kv_port": _port(),
                                   "kv_buffer_size": io_bytes * 6, **extra})


# ---- the config ------------------------------------------------------------------------------------------
def test_config_takes_vllms_shape():
    cfg = KVTransferConfig.parse('{"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_rank": 0, '
                                 '"kv_parallel_size": 2, "kv_ip": "10.0.0.5", "kv_port": 20001, '
                                 '"kv_buffer_size": 5e8, "kv_buffer_device": "cuda", "engine_id": "p0", '
                                 '"kv_connector_extra_config": {"transfer_timeout_s": 2}}')
    assert (cfg.is_producer, cfg.is_consumer, cfg.kv_ip, cfg.kv_port, cfg.engine_id) == \
        (True, True, "10.0.0.5", 20001, "p0")
    assert cfg.transfer_timeout_s == 2.0 and cfg.pin_timeout_s == 120.0
    assert KVTransferConfig.parse(None) is None and KVTransferConfig.parse("") is None


@pytest.mark.parametrize("text, message", [
    ("{bad", "not valid JSON"),
    ("[1]", "must be a JSON object"),
    ('{"kv_connector": "NixlConnector"}', "kv_role must be one of"),
    ('{"kv_connector": "NixlConnector", "kv_role": "producer"}', "kv_role must be one of"),
    ('{"kv_connector": "P2pNcclConnector", "kv_role": "kv_producer"}', "is vLLM's"),
    ('{"kv_connector": "Nope", "kv_role": "kv_producer"}', "kv_connector must be one of"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_prot": 1}', "unknown keys ['kv_prot']"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_port": "1"}', "kv_port must be an integer"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_port": 70000}', "kv_port must be"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_ip": "prefill-0.local"}',
     "kv_ip must be an IP address"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_buffer_size": -1}', "kv_buffer_size"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_load_failure_policy": "fail"}',
     "kv_load_failure_policy must be one of"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_producer", "kv_connector_extra_config": {"x": 1}}',
     "unknown keys ['x']"),
    ('{"kv_connector": "NixlConnector", "kv_role": "kv_producer", '
     '"kv_connector_extra_config": {"transfer_timeout_s": 0}}', "positive number of seconds"),
])
def test_a_bad_config_is_a_clear_error_before_the_model_loads(text, message):
    with pytest.raises(ValueError, match="--kv-transfer-config") as e:
        EngineArgs(kv_transfer_config=text)  # the check every front end (CLI, LLM, serve) goes through
    assert message in str(e.value)


@pytest.mark.parametrize("params, message", [
    ("x", "must be an object"),
    ({"do_remote_decode": "yes"}, "do_remote_decode must be a boolean"),
    ({"do_remote_prefill": True}, "remote_engine_id is missing"),
    ({"do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "h", "remote_port": 1,
      "remote_block_ids": [0], "remote_block_hashes": ["zz" * 16], "remote_buffer": [1, 2]}, "hex digests"),
    ({"do_remote_prefill": True, "remote_engine_id": "p", "remote_host": "h", "remote_port": 1,
      "remote_block_ids": [0, 1], "remote_block_hashes": ["00" * 16], "remote_buffer": [1, 2]}, "one 32-digit"),
])
def test_malformed_transfer_params_are_refused(params, message):
    with pytest.raises(ValueError, match=message):
        check_params(params)


# ---- staging slots ---------------------------------------------------------------------------------------
def test_staging_slots_pin_hold_and_expire():
    st = StagingSlots(4, 8)
    a = st.take(3, pin_seconds=60)
    assert a == [0, 1, 2] and st.take(2, pin_seconds=60) is None  # pinned slots are not reused
    st.release([1])
    b = st.take(2, pin_seconds=0.0)  # pinned for no time: the next shortage frees them
    assert sorted(b) == [1, 3]
    assert st.take(2, pin_seconds=60) is not None  # expired pins taken back
    st.check_invariants()
    st2 = StagingSlots(3, 8)
    s = st2.take(2, pin_seconds=60)
    st2.hold([b"a", b"b"], s)
    assert st2.lookup([b"a", b"b", b"c"]) == 2 and st2.lookup([b"b"]) == 1 and st2.lookup([b"c", b"a"]) == 0
    assert st2.take(3, pin_seconds=60) is None
    s3 = st2.take(2, pin_seconds=60, evict_held=True)  # the least recently held ("a") is given up
    assert s3 is not None and st2.lookup([b"a"]) == 0 and st2.lookup([b"b"]) == 1
    st2.release(s3)
    popped = st2.pop([b"b", b"a"])  # the leading held run; its slots are the caller's until free()
    assert len(popped) == 1 and st2.lookup([b"b"]) == 0
    st2.free(popped)
    st2.check_invariants()
    with pytest.raises(ValueError):
        StagingSlots(0, 8)


# ---- NIXL between two processes ------------------------------------------------------------------------
def _producer(q: mp.Queue, cfg: KVTransferConfig, hold_s: float) -> None:
    torch.manual_seed(0)
    cache = torch.randn(SHAPE)
    conn = PDConnector(cfg, BlockIO([(cache, 2)], SHAPE[2]), SHAPE[3])
    q.put(conn.publish([bytes([i]) * 16 for i in range(3)], [5, 1, 6]))
    deadline = time.monotonic() + hold_s
    while time.monotonic() < deadline:
        conn.poll()
        if conn.staging.num_pinned < 3:
            q.put(conn.staging.num_pinned)  # the slots a consumer read are free again
            break
        time.sleep(0.01)
    time.sleep(hold_s if hold_s < 5 else 0.2)


def _spawn_producer(hold_s: float) -> tuple[mp.Process, dict]:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    proc = ctx.Process(target=_producer, args=(q, _cfg("kv_producer"), hold_s), daemon=True)
    proc.start()
    return proc, q


def _consumer(timeout_s: float = 10) -> tuple[PDConnector, torch.Tensor]:
    cache = torch.zeros(SHAPE)
    conn = PDConnector(_cfg("kv_consumer", kv_connector_extra_config={"transfer_timeout_s": timeout_s}),
                       BlockIO([(cache, 2)], SHAPE[2]), SHAPE[3])
    return conn, cache


def test_nixl_moves_blocks_between_two_processes():
    proc, q = _spawn_producer(hold_s=60)
    try:
        params = q.get(timeout=120)
        assert params["remote_block_ids"] == [0, 1, 2] and len(params["remote_block_hashes"]) == 3
        conn, cache = _consumer()
        digests = [bytes([i]) * 16 for i in range(3)]
        assert conn.fetch(check_params(params), digests[:2] + [b"\xff" * 16]) == 2  # the agreeing leading run
        assert conn.lookup(digests) == 2
        assert conn.load(digests[:2], [0, 3]) == 2
        torch.manual_seed(0)
        ref = torch.randn(SHAPE)
        assert torch.equal(cache[:, :, [0, 3]], ref[:, :, [5, 1]])
        assert cache[:, :, [1, 2, 4, 5, 6, 7]].abs().sum() == 0  # nothing else written
        # the producer heard which slots were read and freed them; the unread one waits for its pin timeout
        assert q.get(timeout=30) == 1
        conn.staging.check_invariants()
        conn.close()
    finally:
        proc.kill()
        proc.join()


def test_a_read_from_a_dead_producer_gives_up_and_holds_nothing():
    proc, q = _spawn_producer(hold_s=60)
    params = q.get(timeout=120)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join()
    conn, cache = _consumer(timeout_s=3)
    digests = [bytes([i]) * 16 for i in range(3)]
    t0 = time.monotonic()
    assert conn.fetch(check_params(params), digests) == 0
    assert time.monotonic() - t0 < 30  # bounded by the timeout (and the connection attempt), never a hang
    assert conn.lookup(digests) == 0 and conn.failed_fetches == 1
    assert cache.abs().sum() == 0
    conn.staging.check_invariants()
    conn.close()


def test_a_producer_of_another_layout_is_not_read():
    proc, q = _spawn_producer(hold_s=60)
    try:
        params = dict(q.get(timeout=120))
        params["remote_buffer"] = [params["remote_buffer"][0], params["remote_buffer"][1] * 2]
        conn, _ = _consumer()
        assert conn.fetch(check_params(params), [bytes([i]) * 16 for i in range(3)]) == 0
        assert conn.failed_fetches == 1
        conn.close()
    finally:
        proc.kill()
        proc.join()


# ---- the fetch thread (pd_fetcher.py) ------------------------------------------------------------------
def _job(rid: str, gate: threading.Event | None = None, result: int = 2, log: list | None = None,
         fail: bool = False) -> FetchJob:
    def run() -> int:
        if gate is not None:
            assert gate.wait(30), "the test never opened the gate"
        if log is not None:
            log.append(rid)
        if fail:
            raise RuntimeError("a bug in the read")
        return result

    dropped = []
    job = FetchJob(rid, run, lambda: dropped.append(rid))
    job.dropped = dropped  # type: ignore[attr-defined]
    return job


def _take(fetcher: BackgroundFetcher, n: int) -> list[FetchJob]:
    done: list[FetchJob] = []
    while len(done) < n:
        assert fetcher.wait(30), "a job never finished"
        done += fetcher.take_done()
    return done


def test_the_fetch_thread_runs_jobs_in_order_off_the_callers_thread():
    fetcher = BackgroundFetcher()
    gate, ran = threading.Event(), []
    jobs = [_job("a", gate, log=ran), _job("b", log=ran), _job("c", log=ran, result=0)]
    for j in jobs:
        fetcher.submit(j)  # returns at once: the first read is held by the gate
    assert fetcher.take_done() == [] and not fetcher.wait(0)
    gate.set()
    done = _take(fetcher, 3)
    assert [j.request_id for j in done] == ran == ["a", "b", "c"]
    assert [j.blocks for j in done] == [2, 2, 0] and not any(j.failed for j in done)
    fetcher.close()
    assert not fetcher._thread.is_alive()  # shutdown joins the thread
    with pytest.raises(RuntimeError, match="closed"):
        fetcher.submit(_job("late"))


def test_a_cancelled_job_is_skipped_or_gives_its_blocks_up():
    fetcher = BackgroundFetcher()
    gate, ran = threading.Event(), []
    running, queued, after = _job("running", gate, log=ran), _job("queued", log=ran), _job("after", log=ran)
    for j in (running, queued, after):
        fetcher.submit(j)
    while fetcher.running is not running:  # the first job is on the thread, held by the gate
        time.sleep(0.001)
    running.cancelled.set()  # its read is under way: it finishes, then drops what it holds
    queued.cancelled.set()  # not started: never run
    gate.set()
    assert [j.request_id for j in _take(fetcher, 1)] == ["after"]  # cancelled jobs are not handed back
    assert ran == ["running", "after"] and running.dropped == ["running"] and queued.dropped == []
    fetcher.close()


def test_a_job_that_raises_is_handed_back_as_failed():
    fetcher = BackgroundFetcher()
    fetcher.submit(_job("bug", fail=True))
    fetcher.submit(_job("fine"))
    done = _take(fetcher, 2)
    assert [(j.request_id, j.blocks, j.failed) for j in done] == [("bug", 0, True), ("fine", 2, False)]
    fetcher.close()


def test_close_cancels_what_waits_and_joins_the_running_read():
    fetcher = BackgroundFetcher()
    gate, ran = threading.Event(), []
    first, second = _job("first", gate, log=ran), _job("second", log=ran)
    fetcher.submit(first)
    fetcher.submit(second)
    while fetcher.running is not first:
        time.sleep(0.001)
    threading.Timer(0.2, gate.set).start()  # the read under way ends a little later
    fetcher.close()
    assert not fetcher._thread.is_alive() and ran == ["first"] and second.cancelled.is_set()
    assert first.dropped == ["first"]  # it ended after close: its blocks were given up


def test_load_writes_runs_of_staging_slots_in_the_order_of_the_digests():
    conn, cache = _consumer()
    io = BlockIO([(cache, 2)], SHAPE[2])
    slots = conn.staging.take(6, pin_seconds=60)
    conn.staging.release([s for s in slots if s not in (1, 2, 4)])
    torch.manual_seed(1)
    conn.staging.buffer[[4, 1, 2]] = torch.randint(0, 255, (3, io.block_nbytes), dtype=torch.uint8)
    want = conn.staging.buffer[[4, 1, 2]].clone()
    digests = [b"x" * 16, b"y" * 16, b"z" * 16]
    conn.staging.hold(digests, [4, 1, 2])  # slot runs [4], [1, 2]
    assert conn.lookup(digests) == 3 and conn.load(digests, [7, 0, 5]) == 3
    assert torch.equal(io.read([7, 0, 5]), want)
    assert cache[:, :, [1, 2, 3, 4, 6]].abs().sum() == 0
    conn.staging.check_invariants()
    conn.close()


class _FailingTransport:
    """Stands in for NixlTransport: every read fails; ``unsafe``: as when its handle could not be released."""

    def __init__(self, unsafe: bool) -> None:
        self.unsafe = unsafe

    def read(self, *args, **kwargs) -> None:
        from tokenfab.engine.kv_transfer.pd_nixl import TransferError

        e = TransferError("the read from p timed out after 3s")
        e.slots_unsafe = self.unsafe
        raise e

    def released_slots(self) -> list[int]:
        return []


@pytest.mark.parametrize("unsafe", [False, True])
def test_a_failed_read_still_in_flight_retires_its_staging_slots(unsafe):
    """A read whose transfer may still write into the staging slots (timed out, handle not released) must not
    hand those slots to the next read; a read that surely ended gives them back."""
    conn, _ = _consumer(timeout_s=3)
    real = conn.transport
    conn.transport = _FailingTransport(unsafe)
    params = {"remote_engine_id": "p", "remote_host": "127.0.0.1", "remote_port": 1,
              "remote_buffer": [0, conn.io.block_nbytes], "remote_block_ids": [0, 1],
              "remote_block_hashes": [(bytes([i]) * 16).hex() for i in range(2)]}
    free_before = conn.staging.num_free
    assert conn.fetch(check_params(params), [bytes([i]) * 16 for i in range(2)]) == 0
    assert conn.failed_fetches == 1
    assert conn.staging.num_free == (free_before - 2 if unsafe else free_before)
    assert conn.staging.num_retired == (2 if unsafe else 0)
    conn.staging.check_invariants()
    conn.transport = real
    conn.close()
