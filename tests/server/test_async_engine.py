"""AsyncEngine's threading and bookkeeping, on a fast fake engine (no model)."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.server.fake_engine import FakeEngine
from tokenfab.engine.core.async_engine import AsyncEngine, EngineDeadError, QueueFullError
from tokenfab.engine.requests.sampling_params import SamplingParams


def _run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def _collect(stream):
    await stream.wait_accepted()
    return [c async for c in stream]


def test_streams_deltas_and_final_text():
    engine = AsyncEngine(FakeEngine())

    async def main():
        stream = engine.add_request("r1", "hello", SamplingParams(max_tokens=5, seed=1))
        return await _collect(stream)

    try:
        chunks = _run(main())
    finally:
        engine.shutdown()
    assert [c.finish_reason for c in chunks][-1] == "length"
    assert all(c.finish_reason is None for c in chunks[:-1])
    assert "".join(c.delta_text for c in chunks) == chunks[-1].text
    assert sum(len(c.delta_token_ids) for c in chunks) == len(chunks[-1].token_ids) == 5
    assert chunks[-1].num_prompt_tokens == 5


def test_n_fans_out_with_seed_offsets_and_merges():
    fake = FakeEngine()
    engine = AsyncEngine(fake)

    async def main():
        s1 = engine.add_request("a", "hi", SamplingParams(n=3, max_tokens=4, seed=10))
        s2 = engine.add_request("b", "hi", SamplingParams(n=1, max_tokens=4, seed=11))
        return await _collect(s1), await _collect(s2)

    try:
        many, one = _run(main())
    finally:
        engine.shutdown()
    finals = {c.index: c for c in many if c.finished}
    assert sorted(finals) == [0, 1, 2]
    # choice 1 of the seeded n=3 request samples exactly like a single request with seed + 1
    assert finals[1].token_ids == [c for c in one if c.finished][0].token_ids
    assert len({tuple(c.token_ids) for c in finals.values()}) == 3


def test_several_prompts_get_choice_indices():
    engine = AsyncEngine(FakeEngine())

    async def main():
        stream = engine.add_requests("p", ["ab", "abcd"], SamplingParams(n=2, max_tokens=2))
        return await _collect(stream)

    try:
        chunks = _run(main())
    finally:
        engine.shutdown()
    finals = {c.index: c for c in chunks if c.finished}
    assert sorted(finals) == [0, 1, 2, 3]
    assert [finals[i].prompt_index for i in range(4)] == [0, 0, 1, 1]
    assert [finals[i].num_prompt_tokens for i in range(4)] == [2, 2, 4, 4]


def test_engine_rejection_surfaces_from_wait_accepted():
    engine = AsyncEngine(FakeEngine(max_model_len=16))

    async def main():
        stream = engine.add_request("long", "x" * 40, SamplingParams(max_tokens=2))
        with pytest.raises(ValueError, match="context"):
            await stream.wait_accepted()
        # still serving
        ok = engine.add_request("ok", "x", SamplingParams(max_tokens=2))
        return await _collect(ok)

    try:
        chunks = _run(main())
    finally:
        engine.shutdown()
    assert chunks[-1].finished


def test_abort_stops_generation_and_wakes_consumer():
    fake = FakeEngine(step_time=0.005)
    engine = AsyncEngine(fake)

    class Gone(Exception):
        pass

    async def main():
        stream = engine.add_request("x", "hello", SamplingParams(max_tokens=100_000))
        await stream.wait_accepted()
        seen = 0
        with pytest.raises(Gone):
            async for _ in stream:
                seen += 1
                if seen == 3:
                    stream.abort(Gone())
        for _ in range(200):
            if not fake.has_unfinished_requests():
                break
            await asyncio.sleep(0.01)
        return seen

    try:
        _run(main())
        assert not fake.has_unfinished_requests()
    finally:
        engine.shutdown()


def test_batch_stays_full_as_requests_come_and_go():
    fake = FakeEngine(step_time=0.002, max_num_seqs=4)
    engine = AsyncEngine(fake)

    async def main():
        streams = []
        for i in range(12):
            streams.append(engine.add_request(f"r{i}", "hi", SamplingParams(max_tokens=3 + i % 5)))
            await asyncio.sleep(0.001)
        return await asyncio.gather(*(_collect(s) for s in streams))

    try:
        results = _run(main())
    finally:
        engine.shutdown()
    assert all(r[-1].finished for r in results)
    assert fake.max_batch_seen == 4
    # 12 requests of 3..7 tokens on 4 slots: far fewer steps than running them one by one
    assert fake.steps < sum(3 + i % 5 for i in range(12))


def test_max_waiting_rejects_at_once():
    fake = FakeEngine(step_time=0.01, max_num_seqs=1)
    engine = AsyncEngine(fake, max_waiting=2)

    async def main():
        first = engine.add_request("a", "hi", SamplingParams(max_tokens=50))
        await first.wait_accepted()
        while engine.num_running() < 1:
            await asyncio.sleep(0.01)
        queued = [engine.add_request(f"q{i}", "hi", SamplingParams(max_tokens=2)) for i in range(2)]
        t0 = time.monotonic()
        with pytest.raises(QueueFullError):
            engine.add_request("overflow", "hi", SamplingParams(max_tokens=2))
        assert time.monotonic() - t0 < 0.5
        first.abort()
        return [await _collect(q) for q in queued]

    try:
        results = _run(main())
    finally:
        engine.shutdown()
    assert all(r[-1].finished for r in results)


def test_shutdown_drains_then_refuses():
    fake = FakeEngine(step_time=0.005)
    engine = AsyncEngine(fake)

    async def main():
        stream = engine.add_request("a", "hi", SamplingParams(max_tokens=20))
        await stream.wait_accepted()
        await asyncio.to_thread(engine.shutdown, 10.0)
        chunks = [c async for c in stream]
        with pytest.raises(EngineDeadError):
            engine.add_request("b", "hi", SamplingParams(max_tokens=2))
        return chunks

    chunks = _run(main())
    assert chunks[-1].finish_reason == "length" and len(chunks[-1].token_ids) == 20
