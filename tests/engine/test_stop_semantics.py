"""When a request stops, through the engine on a tiny model: EOS (from the model's config),
``ignore_eos``, ``stop_token_ids``, ``max_tokens`` and ``min_tokens``; all judged against the
request's own greedy continuation, which is known in advance."""

from __future__ import annotations

import json
import shutil

import pytest

from tokenfab.engine.llm import LLM
from tokenfab.engine.requests.sampling_params import SamplingParams

PROMPT = [5, 17, 42, 99, 7]
N = 14


@pytest.fixture(scope="module")
def greedy(tiny_llama_dir):
    """The prompt's greedy continuation, never stopped early, and a token that first appears in
    it at position j >= 2 (to serve as EOS or a stop id)."""
    llm = LLM(tiny_llama_dir, num_kv_blocks=64)
    out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))[0]
    toks = out.outputs[0].token_ids
    j = next(i for i in range(2, N) if toks[i] not in toks[:i])
    return llm, toks, j


@pytest.fixture(scope="module")
def eos_llm(tiny_llama_dir, greedy, tmp_path_factory):
    """The same weights with the config's eos_token_id set to the chosen token."""
    _, toks, j = greedy
    path = tmp_path_factory.mktemp("tiny-llama-eos")
    shutil.copytree(tiny_llama_dir, path, dirs_exist_ok=True)
    cfg = json.loads((path / "config.json").read_text())
    cfg["eos_token_id"] = toks[j]
    (path / "config.json").write_text(json.dumps(cfg))
    llm = LLM(str(path), num_kv_blocks=64)
    assert toks[j] in llm.engine.eos_token_ids
    return llm


def _gen(llm, **params):
    return llm.generate([PROMPT], SamplingParams(temperature=0, **params))[0].outputs[0]


def test_eos_stops_with_the_eos_token_last(greedy, eos_llm):
    _, toks, j = greedy
    c = _gen(eos_llm, max_tokens=N)
    assert c.token_ids == toks[: j + 1] and c.finish_reason == "stop"


def test_ignore_eos_runs_to_max_tokens(greedy, eos_llm):
    _, toks, _ = greedy
    c = _gen(eos_llm, max_tokens=N, ignore_eos=True)
    assert c.token_ids == toks and c.finish_reason == "length"


def test_min_tokens_holds_eos_back(greedy, eos_llm):
    _, toks, j = greedy
    c = _gen(eos_llm, max_tokens=N, min_tokens=j + 2)
    assert c.token_ids[:j] == toks[:j]  # identical until the EOS would have come
    assert toks[j] not in c.token_ids[: j + 2]
    assert len(c.token_ids) >= j + 2
    if c.finish_reason == "stop":  # stopped by a later EOS: it is the last token
        assert c.token_ids[-1] == toks[j] and toks[j] not in c.token_ids[:-1]
    else:
        assert c.finish_reason == "length" and len(c.token_ids) == N


def test_stop_token_id_stops_and_is_reported(greedy):
    llm, toks, j = greedy
    c = _gen(llm, max_tokens=N, stop_token_ids=[toks[j]], ignore_eos=True)
    assert c.token_ids == toks[: j + 1] and c.finish_reason == "stop" and c.stop_reason == toks[j]
    # a stop id that never comes: no effect
    absent = next(t for t in range(320) if t not in toks)
    c = _gen(llm, max_tokens=N, stop_token_ids=[absent], ignore_eos=True)
    assert c.token_ids == toks and c.finish_reason == "length"


def test_stop_token_ids_with_ignore_eos_still_stop(greedy, eos_llm):
    """ignore_eos frees EOS only; a stop id is a stop whatever ignore_eos says."""
    _, toks, j = greedy
    k = next(i for i in range(j + 1, N) if toks[i] not in toks[:i])
    c = _gen(eos_llm, max_tokens=N, ignore_eos=True, stop_token_ids=[toks[k]])
    assert c.token_ids == toks[: k + 1] and c.finish_reason == "stop"


@pytest.mark.parametrize("max_tokens", [1, 3, N])
def test_max_tokens_is_exact(greedy, max_tokens):
    llm, toks, _ = greedy
    c = _gen(llm, max_tokens=max_tokens, ignore_eos=True)
    assert c.token_ids == toks[:max_tokens] and c.finish_reason == "length"


def test_first_of_several_stops_wins(greedy):
    llm, toks, j = greedy
    later = next(i for i in range(j + 1, N) if toks[i] not in toks[:i])
    c = _gen(llm, max_tokens=N, stop_token_ids=[toks[later], toks[j]], ignore_eos=True)
    assert c.token_ids == toks[: j + 1] and c.stop_reason == toks[j]
