"""The consumer parks a decode leg while its blocks are read on the fetch thread (``engine/runner/pd_hook.py``,
``engine/kv_transfer/pd_fetcher.py``): a producer and a consumer engine in this process (NIXL between them, no HTTP),
with the consumer's NIXL read held behind a gate where a test needs a read in flight.

- a parked request is unfinished but not scheduled; the engine keeps stepping (waiting briefly when it has nothing
  else) and, once the read is in, decodes it with the transferred blocks: greedy equal to one instance;
- a running stream completes while other requests' reads are held (the reads do not block the engine);
- several parked requests complete; abort while parked (read under way, or still queued) leaves no held block;
- a read that fails, raises, or outlives its deadline: the request is prefilled locally, same answer."""

from __future__ import annotations

import threading

import pytest

from tests.server.pd_harness import ENGINE, prompts, transfer_config
from tokenfab import LLM, SamplingParams
from tokenfab.engine.kv_transfer import pd_nixl
from tokenfab.engine.runner import pd_hook

MAX_TOKENS = 4
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def engines():
    extra = {"kv_connector_extra_config": {"transfer_timeout_s": 60}}  # no deadline on a loaded machine
    producer = LLM(kv_transfer_config=transfer_config("kv_producer", **extra), **ENGINE)
    consumer = LLM(kv_transfer_config=transfer_config("kv_consumer", **extra), **ENGINE)
    reference = LLM(**ENGINE)
    yield producer.engine, consumer.engine, reference
    consumer.engine.shutdown()
    producer.engine.shutdown()
    assert not consumer.engine.kv_transfer.fetcher._thread.is_alive()  # shutdown joined the fetch thread


class Gate:
    """Holds the consumer's NIXL reads until opened; counts them."""

    def __init__(self, transport: pd_nixl.NixlTransport, monkeypatch: pytest.MonkeyPatch, fail: bool = False):
        self.open, self.started, self.reads = threading.Event(), threading.Event(), 0
        real = transport.read

        def read(*args: object, **kwargs: object) -> None:
            self.reads += 1
            self.started.set()
            assert self.open.wait(60), "the test never opened the gate"
            if fail:
                raise pd_nixl.TransferError("the test's read failed")
            real(*args, **kwargs)

        monkeypatch.setattr(transport, "read", read)


_counter = iter(range(10**6))


def _prefill_leg(producer, text: str) -> dict:
    """The producer's answer to the router's prefill leg: the kv_transfer_params for the consumer."""
    rid = f"prefill-{next(_counter)}"
    producer.add_request(
        rid, text, SamplingParams(temperature=0, max_tokens=1, kv_transfer_params={"do_remote_decode": True})
    )
    while producer.has_unfinished_requests():
        for out in producer.step():
            if out.request_id == rid and out.finished:
                params = out.kv_transfer_params
    assert params["remote_block_ids"], "the prompt has no full block to hand over"
    return params


def _decode_leg(consumer, text: str, params: dict) -> str:
    rid = f"decode-{next(_counter)}"
    consumer.add_request(rid, text, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, kv_transfer_params=params))
    return rid


def _run(engine, steps_limit: int = 10_000) -> dict[str, object]:
    """Step until nothing is unfinished; the finished outputs by request id."""
    done = {}
    for _ in range(steps_limit):
        if not engine.has_unfinished_requests():
            return done
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    raise AssertionError("the engine did not finish its requests")


def _texts(n: int, tag: str) -> list[str]:
    """``n`` prompts of several full blocks each, none seen before by either engine."""
    topics = prompts(15)
    return [f"{tag} {i}: " + " ".join(topics[(i + j + 2) % 15] for j in range(3)) for i in range(n)]


def _expected(reference: LLM, texts: list[str]) -> list[str]:
    return [o.outputs[0].text for o in reference.generate(texts, GREEDY)]


def test_a_parked_request_keeps_the_loop_alive_and_decodes_the_transferred_blocks(engines, monkeypatch):
    producer, consumer, reference = engines
    hook = consumer.kv_transfer
    gate = Gate(hook.connector.transport, monkeypatch)
    waits = []
    real_wait = hook.fetcher.wait
    monkeypatch.setattr(hook.fetcher, "wait", lambda t: waits.append(t) or real_wait(t))
    text = _texts(1, "parked")[0]
    rid = _decode_leg(consumer, text, _prefill_leg(producer, text))
    assert gate.started.wait(30)
    for _ in range(3):  # the read is held: nothing to run, yet the request is not lost
        assert consumer.has_unfinished_requests() and consumer.get_stats().num_waiting == 1
        assert consumer.step() == [] and not consumer.scheduler.waiting
    assert waits == [pd_hook.PARKED_WAIT_S] * 3  # each idle step waited for the read: the loop does not spin
    hits = consumer.block_manager.connector_hits
    gate.open.set()
    out = _run(consumer)[rid]
    assert out.outputs[0].text == _expected(reference, [text])[0]
    n = len(out.prompt_token_ids)
    assert consumer.block_manager.connector_hits - hits == (n - 1) // ENGINE["block_size"] * ENGINE["block_size"]
    assert out.num_cached_tokens > 0 and hook.num_parked == 0


def test_a_stream_runs_to_the_end_while_reads_are_held_and_all_complete(engines, monkeypatch):
    producer, consumer, reference = engines
    hook = consumer.kv_transfer
    gate = Gate(hook.connector.transport, monkeypatch)
    texts = _texts(3, "several")
    params = [_prefill_leg(producer, t) for t in texts]
    rids = [_decode_leg(consumer, t, p) for t, p in zip(texts, params)]
    consumer.add_request("plain", "Write about the sea.", GREEDY)
    assert gate.started.wait(30)
    plain = None
    while plain is None:  # the plain request decodes to its end while every read is held
        plain = next((o for o in consumer.step() if o.request_id == "plain" and o.finished), None)
    assert hook.num_parked == 3 and gate.reads == 1
    assert plain.outputs[0].text == _expected(reference, ["Write about the sea."])[0]
    gate.open.set()
    done = _run(consumer)
    assert [done[r].outputs[0].text for r in rids] == _expected(reference, texts)
    assert gate.reads == 3 and all(done[r].num_cached_tokens > 0 for r in rids)


def test_abort_while_parked_cancels_the_read_and_holds_nothing(engines, monkeypatch):
    producer, consumer, _ = engines
    hook, conn = consumer.kv_transfer, consumer.kv_transfer.connector
    gate = Gate(conn.transport, monkeypatch)
    texts = _texts(2, "aborted")
    under_way, queued = (_decode_leg(consumer, t, _prefill_leg(producer, t)) for t in texts)
    assert gate.started.wait(30)
    consumer.abort_request(under_way)  # its read is in flight: it ends, then its blocks are given up
    consumer.abort_request(queued)  # not started: never read
    assert not consumer.has_unfinished_requests() and hook.num_parked == 0
    gate.open.set()
    while hook.fetcher.running is not None or hook.fetcher._queue:
        hook.fetcher.wait(0.01)
    assert gate.reads == 1
    assert consumer.step() == [] and conn.staging.num_held == 0 and conn.staging.num_pinned == 0
    conn.staging.check_invariants()


@pytest.mark.parametrize("how", ["fails", "raises", "outlives its deadline"])
def test_a_read_that_does_not_deliver_falls_back_to_a_local_prefill(engines, monkeypatch, how):
    producer, consumer, reference = engines
    hook, conn = consumer.kv_transfer, consumer.kv_transfer.connector
    gate = Gate(conn.transport, monkeypatch, fail=how == "fails")
    if how == "raises":
        monkeypatch.setattr(conn, "fetch", lambda *a: 1 // 0)
    if how == "outlives its deadline":  # queued at once, whatever its read does (held by the gate here)
        monkeypatch.setattr(pd_hook, "PARK_GRACE_S", -hook.cfg.transfer_timeout_s)
    else:
        gate.open.set()
    failed = conn.failed_fetches
    text = _texts(1, f"fallback {how}")[0]
    rid = _decode_leg(consumer, text, _prefill_leg(producer, text))
    if how != "raises":
        assert gate.started.wait(30)  # the read under way (held by the gate when it outlives its deadline)
    out = _run(consumer)[rid]
    assert out.outputs[0].text == _expected(reference, [text])[0]
    assert out.num_cached_tokens == 0  # all of it prefilled here
    assert conn.failed_fetches == failed + (how == "fails")
    if how == "outlives its deadline":
        gate.open.set()  # the read ends after its request moved on: its blocks are given up
        while hook.fetcher.running is not None:
            hook.fetcher.wait(0.01)
        assert conn.staging.num_held == 0
    conn.staging.check_invariants()


def test_a_tail_rides_along_decode_steps_a_token_at_a_time(engines):
    producer, consumer, reference = engines
    assert consumer.kv_transfer.throttle_tails  # a CPU engine
    text = _texts(1, "tail")[0] + " And one more line."
    params = _prefill_leg(producer, text)
    consumer.add_request("decoding", "Write about glass.", SamplingParams(temperature=0, max_tokens=400))
    while not consumer.scheduler.running or not consumer.scheduler.running[0].is_decoding:
        consumer.step()
    rid = _decode_leg(consumer, text, params)
    chunks, done = [], {}
    while rid not in done:  # the other request decodes throughout (it has 400 tokens to go)
        for out in consumer.step():
            if out.finished:
                done[out.request_id] = out
        chunks.append(consumer.get_stats().last_step_prefill_tokens)
    consumer.abort_request("decoding")
    n, block = len(done[rid].prompt_token_ids), ENGINE["block_size"]
    tail = n - (n - 1) // block * block  # the tokens after the transferred blocks
    assert tail > 1 and chunks.count(1) == tail and max(chunks) == 1  # one prompt token a step
    assert done[rid].outputs[0].text == _expected(reference, [text])[0]
