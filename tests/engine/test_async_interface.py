"""AsyncEngine's side of the server contract, on the tiny model: prompt logprobs on the first chunk
of each choice, cache_salt forwarded, check_request from the event loop, every choice counted
against max_waiting."""

from __future__ import annotations

import asyncio

import pytest

from tokenfab.engine.core.async_engine import AsyncEngine, QueueFullError
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.requests.sampling_params import SamplingParams

PROMPTS = [[5, 17, 42, 99, 3, 8], [1, 2, 3]]


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLMEngine(model=tiny_llama_dir, num_kv_blocks=100, block_size=4)


async def collect(stream):
    await stream.wait_accepted()
    return [c async for c in stream]


def test_prompt_logprobs_come_once_per_choice(engine):
    front = AsyncEngine(engine)
    params = SamplingParams(n=2, temperature=0, max_tokens=3, ignore_eos=True, prompt_logprobs=2)
    async def main():
        return await collect(front.add_requests("r", PROMPTS, params))

    try:
        chunks = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        front.shutdown()
    for index in range(4):
        mine = [c for c in chunks if c.index == index]
        with_lp = [c for c in mine if c.prompt_logprobs is not None]
        assert len(with_lp) == 1 and with_lp[0] is mine[0]
        plp = with_lp[0].prompt_logprobs
        prompt = PROMPTS[index // 2]
        assert len(plp) == len(prompt) and plp[0] is None
        assert all(prompt[i] in plp[i] and len(plp[i]) in (2, 3) for i in range(1, len(prompt)))


def test_cache_salt_reaches_the_engine_and_check_request_is_pure(engine):
    front = AsyncEngine(engine)
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
    prompt = list(range(10, 30))

    async def main():
        with pytest.raises(ValueError, match="^stop_token_ids"):
            front.check_request(prompt, SamplingParams(stop_token_ids=[10_000]))
        a = await collect(front.add_request("a", prompt, params, cache_salt="tenant-1"))
        b = await collect(front.add_request("b", prompt, params, cache_salt="tenant-2"))
        c = await collect(front.add_request("c", prompt, params, cache_salt="tenant-1"))
        return a[-1], b[-1], c[-1]

    try:
        a, b, c = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        front.shutdown()
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 0)
    assert c.num_cached_tokens == 16 and c.token_ids == a.token_ids
    assert front.vocab_size == 320 and front.scheduling_policy == "fcfs" and not front.is_dead


def test_every_choice_counts_against_max_waiting(engine):
    front = AsyncEngine(engine, max_waiting=5)

    async def main():
        with pytest.raises(QueueFullError, match="adds 6"):
            front.add_requests("big", PROMPTS, SamplingParams(n=3, max_tokens=2))
        ok = front.add_requests("fits", PROMPTS, SamplingParams(n=2, max_tokens=2))  # 4 choices
        with pytest.raises(QueueFullError):
            front.add_requests("more", PROMPTS, SamplingParams(n=1, max_tokens=2))  # 4 + 2 > 5
        return await collect(ok)

    try:
        chunks = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        front.shutdown()
    assert sorted(c.index for c in chunks if c.finished) == [0, 1, 2, 3]
