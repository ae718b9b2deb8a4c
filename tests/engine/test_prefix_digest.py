"""The prefix-cache key is a chained BLAKE2b digest (not Python's ``hash()``), stable across
processes; ``cache_salt`` isolates requests: different salts never share blocks, equal ones do."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from array import array

import pytest

from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.requests.block_manager import hash_block, root_digest
from tokenfab.engine.requests.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
PROMPT = list(range(3, 3 + 40))  # two full blocks of 16 and a partial one


def test_digest_is_blake2b_of_parent_and_int32_tokens():
    parent = root_digest()
    expected = hashlib.blake2b(parent, digest_size=16)
    expected.update(array("i", [1, 2, 300]).tobytes())
    assert hash_block(parent, [1, 2, 300]) == expected.digest()
    assert hash_block(parent, [1, 2]) != hash_block(parent, [1, 2, 0])
    assert hash_block(hash_block(parent, [1]), [2]) != hash_block(hash_block(parent, [2]), [1])
    assert root_digest("a") != root_digest("b") != root_digest() and root_digest("a") == root_digest("a")


def test_digests_are_stable_across_processes():
    code = ("from tokenfab.engine.requests.block_manager import hash_block, root_digest; "
            "print(hash_block(hash_block(root_digest('s'), [1, 2, 3]), [4]).hex())")
    here = hash_block(hash_block(root_digest("s"), [1, 2, 3]), [4]).hex()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == here


@pytest.fixture(scope="module")
def engine(tiny_llama_dir):
    return LLMEngine(model=tiny_llama_dir, num_kv_blocks=100, block_size=16)


def run_one(engine, rid, salt):
    engine.add_request(rid, PROMPT, GREEDY, cache_salt=salt)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                return out


def test_salts_isolate_and_equal_salts_share(engine):
    first = run_one(engine, "a1", "alice")
    assert first.num_cached_tokens == 0
    assert run_one(engine, "b1", "bob").num_cached_tokens == 0
    assert run_one(engine, "n1", None).num_cached_tokens == 0
    again = run_one(engine, "a2", "alice")
    assert again.num_cached_tokens == 32  # both full blocks reused
    assert run_one(engine, "n2", None).num_cached_tokens == 32
    assert run_one(engine, "b2", "bob").num_cached_tokens == 32
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    engine.block_manager.check_invariants()


def test_salt_changes_only_the_first_block_parent(engine):
    """Later blocks chain on their parent only, so the salt reaches them through the first one."""
    bm = engine.block_manager
    from tokenfab.engine.requests.sequence import Sequence

    s1 = Sequence("x", None, PROMPT, GREEDY, 0, cache_salt="k")
    s2 = Sequence("y", None, PROMPT, GREEDY, 0, cache_salt=None)
    h1, h2 = bm._full_block_hashes(s1, 32), bm._full_block_hashes(s2, 32)
    assert h1[0] == hash_block(root_digest("k"), PROMPT[:16]) and h2[0] == hash_block(root_digest(), PROMPT[:16])
    assert h1[1] == hash_block(h1[0], PROMPT[16:32]) and h1[1] != h2[1]
