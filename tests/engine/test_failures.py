"""A failure inside a step fails only the requests it belongs to; a device error kills the engine
cleanly (EngineDeadError), through LLMEngine and through AsyncEngine."""

from __future__ import annotations

import asyncio

import pytest

from tokenfab.engine.core.async_engine import AsyncEngine
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.requests.errors import EngineDeadError, RequestFailedError
from tokenfab.engine.requests.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = [[5, 17, 42, 99], [1, 2, 3, 4, 5, 6, 7, 8, 9], [7, 300, 12, 40, 41]]
POISON = 311  # a token whose presence in a batch makes our patched forward raise


class BrokenConstraint:
    """Masks nothing, then raises from mask_logits (or accept_token) after ``after`` calls."""

    def __init__(self, after: int, where: str = "mask") -> None:
        self.calls, self.after, self.where = 0, after, where

    def _tick(self, where: str) -> None:
        if where == self.where:
            self.calls += 1
            if self.calls > self.after:
                raise RuntimeError("grammar exploded")

    def mask_logits(self, logits) -> None:
        self._tick("mask")

    def accept_token(self, token_id: int) -> None:
        self._tick("accept")

    def is_terminated(self) -> bool:
        return False


def make_engine(tiny_llama_dir) -> LLMEngine:
    return LLMEngine(model=tiny_llama_dir, num_kv_blocks=200)


def run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]]):
    for rid, (prompt, params) in requests.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    done = run(make_engine(tiny_llama_dir), {f"r{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)})
    return {rid: out.outputs[0].token_ids for rid, out in done.items()}


def poison_forward(monkeypatch, engine: LLMEngine, message: str = "kernel blew up") -> None:
    model = engine.runner.model
    inner = model.forward

    def forward(batch, *a, **kw):
        if bool((batch.input_ids == POISON).any()):
            raise RuntimeError(message)
        return inner(batch, *a, **kw)

    monkeypatch.setattr(model, "forward", forward)


def assert_others_unchanged(done, reference, bad: str, error_text: str) -> None:
    assert done[bad].outputs[0].finish_reason == "error"
    assert error_text in done[bad].error
    for rid, tokens in reference.items():
        assert done[rid].outputs[0].token_ids == tokens
        assert done[rid].outputs[0].finish_reason == "length"
        assert done[rid].error is None


@pytest.mark.parametrize("after, where", [(0, "mask"), (3, "mask"), (2, "accept")])
def test_failing_constraint_fails_only_its_request(tiny_llama_dir, reference, after, where):
    engine = make_engine(tiny_llama_dir)
    reqs = {f"r{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)}
    bad = SamplingParams(temperature=0, max_tokens=8, constraint=BrokenConstraint(after, where))
    reqs["bad"] = ([9, 8, 7], bad)
    done = run(engine, reqs)
    assert_others_unchanged(done, reference, "bad", "grammar exploded")
    assert len(done["bad"].outputs[0].token_ids) == (after if where == "mask" else after + 1)
    assert engine.block_manager.num_used_blocks == 0


def test_failing_forward_fails_only_the_culprit(tiny_llama_dir, reference, monkeypatch):
    engine = make_engine(tiny_llama_dir)
    poison_forward(monkeypatch, engine)
    reqs = {f"r{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)}
    reqs["bad"] = ([4, POISON, 6], GREEDY)
    done = run(engine, reqs)
    assert_others_unchanged(done, reference, "bad", "kernel blew up")
    assert done["bad"].outputs[0].token_ids == []
    assert engine.block_manager.num_used_blocks == 0
    # the engine goes on serving
    again = run(engine, {"later": (PROMPTS[0], GREEDY)})
    assert again["later"].outputs[0].token_ids == reference["r0"]


def test_device_error_is_fatal(tiny_llama_dir, monkeypatch):
    engine = make_engine(tiny_llama_dir)
    poison_forward(monkeypatch, engine, "CUDA error: an illegal memory access was encountered")
    engine.add_request("ok", PROMPTS[0], GREEDY)
    engine.add_request("bad", [POISON, 1], GREEDY)
    with pytest.raises(EngineDeadError, match="CUDA error"):
        engine.step()


async def _consume(stream):
    await stream.wait_accepted()
    return [c async for c in stream]


def _async_run(engine: AsyncEngine, requests: dict[str, tuple[list[int], SamplingParams]]):
    async def main():
        streams = {rid: engine.add_request(rid, p, sp) for rid, (p, sp) in requests.items()}
        results = await asyncio.gather(*(_consume(s) for s in streams.values()), return_exceptions=True)
        return dict(zip(streams, results))

    return asyncio.run(asyncio.wait_for(main(), 120))


def test_async_engine_request_failure_reaches_only_its_stream(tiny_llama_dir, reference, monkeypatch):
    engine = make_engine(tiny_llama_dir)
    poison_forward(monkeypatch, engine)
    front = AsyncEngine(engine)
    try:
        reqs = {f"r{i}": (p, GREEDY) for i, p in enumerate(PROMPTS)}
        reqs["bad"] = ([4, POISON, 6], GREEDY)
        reqs["bad-grammar"] = ([9, 8], SamplingParams(temperature=0, max_tokens=8, constraint=BrokenConstraint(1)))
        results = _async_run(front, reqs)
        assert isinstance(results["bad"], RequestFailedError) and "kernel blew up" in str(results["bad"])
        assert isinstance(results["bad-grammar"], RequestFailedError)
        for rid, tokens in reference.items():
            chunks = results[rid]
            assert chunks[-1].finish_reason == "length"
            assert chunks[-1].token_ids == tokens
        assert not front.is_dead and front.error is None
        again = _async_run(front, {"later": (PROMPTS[1], GREEDY)})
        assert again["later"][-1].token_ids == reference["r1"]
    finally:
        front.shutdown()


def test_async_engine_dies_on_device_error(tiny_llama_dir, monkeypatch):
    engine = make_engine(tiny_llama_dir)
    poison_forward(monkeypatch, engine, "CUDA error: device-side assert triggered")
    front = AsyncEngine(engine)
    try:
        reqs = {"ok": (PROMPTS[0], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)),
                "bad": ([POISON, 2], GREEDY)}
        results = _async_run(front, reqs)
        assert all(isinstance(r, EngineDeadError) for r in results.values())
        assert front.is_dead and not front.is_running
        assert isinstance(front.error, EngineDeadError)

        async def submit():
            front.add_request("new", PROMPTS[0], GREEDY)

        with pytest.raises(EngineDeadError):
            asyncio.run(submit())
    finally:
        front.shutdown()


def test_llm_generate_returns_the_failed_request_and_the_others(tiny_llama_dir, reference):
    from tokenfab.engine.llm import LLM

    llm = LLM(tiny_llama_dir, num_kv_blocks=200)
    bad = SamplingParams(temperature=0, max_tokens=8, constraint=BrokenConstraint(2))
    outs = llm.generate(PROMPTS + [[9, 8, 7]], [GREEDY] * len(PROMPTS) + [bad])
    assert [o.outputs[0].token_ids for o in outs[:-1]] == [reference[f"r{i}"] for i in range(len(PROMPTS))]
    assert all(o.error is None for o in outs[:-1])
    assert outs[-1].outputs[0].finish_reason == "error" and "grammar exploded" in outs[-1].error
    assert not llm.engine.has_unfinished_requests()
