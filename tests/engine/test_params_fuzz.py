"""hypothesis over SamplingParams: any combination either raises ValueError (at construction or in
check_request) or is served by the engine without a step failure. Bounded: few examples, short
generations on the tiny model (context 48)."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from tokenfab.engine.llm import LLM
from tokenfab.engine.requests.sampling_params import SamplingParams

VOCAB = 320


WILD_INTS = st.sampled_from([-(2**63), -1, 0, 1, VOCAB - 1, VOCAB, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64])
WILD_FLOATS = st.sampled_from([math.nan, math.inf, -math.inf, -1.0, 0.0, 1.0, 1e-9, 3.0, 100.0])


def mostly(good, wild):
    """The plausible strategy seven times in eight, a wild value otherwise (with ~17 fields, wild
    values everywhere would leave almost nothing for the engine to serve)."""
    return st.one_of(*[good] * 7, wild)


def ints(lo: int, hi: int):
    return mostly(st.integers(lo, hi), WILD_INTS)


def floats(lo: float, hi: float):
    return mostly(st.floats(lo, hi), WILD_FLOATS)


token = mostly(st.integers(0, VOCAB - 1), WILD_INTS)
valid_token = st.integers(0, VOCAB - 1)

params_kwargs = st.fixed_dictionaries({}, optional={
    "n": ints(1, 3),
    "temperature": floats(0, 2),
    "top_p": floats(0.01, 1),
    "top_k": ints(-1, 400),
    "min_p": floats(0, 1),
    "seed": st.one_of(st.none(), ints(0, 2**63 - 1)),
    "presence_penalty": floats(-2, 2),
    "frequency_penalty": floats(-2, 2),
    "repetition_penalty": floats(0.5, 2),
    "max_tokens": st.one_of(st.none(), ints(0, 6)),
    "min_tokens": ints(0, 6),
    "stop": st.one_of(st.none(), st.text(max_size=3), st.lists(st.text(max_size=3), max_size=2)),
    "stop_token_ids": st.one_of(st.none(), st.lists(token, max_size=3)),
    "ignore_eos": st.booleans(),
    "logprobs": st.one_of(st.none(), ints(0, 5)),
    "prompt_logprobs": st.one_of(st.none(), ints(0, 5)),
    "logit_bias": st.one_of(st.none(), st.dictionaries(st.one_of(token, valid_token.map(str)), floats(-100, 100),
                                                       max_size=3)),
})
prompts = mostly(st.lists(valid_token, min_size=1, max_size=12), st.lists(token, max_size=50))


@pytest.fixture(scope="module")
def llm(tiny_llama_dir):
    return LLM(tiny_llama_dir, num_kv_blocks=64, max_model_len=48, block_size=8)


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(kwargs=params_kwargs, prompt=prompts)
def test_params_are_rejected_or_served(llm, kwargs, prompt):
    try:
        params = SamplingParams(**kwargs)
    except ValueError:
        event("rejected by SamplingParams")
        return
    try:
        llm.engine.check_request(prompt, params)
    except ValueError:
        with pytest.raises(ValueError):  # the offline API refuses it the same way, queueing nothing
            llm.generate([prompt], params)
        assert not llm.engine.has_unfinished_requests()
        event("rejected by check_request")
        return
    event("served")
    outs = llm.generate([prompt], params)
    assert not llm.engine.has_unfinished_requests()
    for c in outs[0].outputs:
        assert c.finish_reason in ("stop", "length"), (c.finish_reason, outs[0].error)
        if params.max_tokens is not None:
            assert len(c.token_ids) <= params.max_tokens
    if params.prompt_logprobs is not None:
        assert len(outs[0].prompt_logprobs) == len(prompt)
    assert llm.engine.block_manager.num_used_blocks == 0
