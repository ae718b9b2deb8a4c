"""Attention-DP + EP serving (``--data-parallel-size N --enable-expert-parallel``, executors/dp_lockstep.py).

Fast tier: the lockstep module with fake collectives (two replicas as threads, an in-memory MAX
all-reduce; stub MoE layers that record the rows they get): the flags reduce, a step that ran no
forward takes part with the empty pass, a failed all-reduce is an EngineDeadError; the options
the layout refuses; DPClient in this mode: one dead replica, all dead.

Slow tier: two engine-core replicas of the tiny DeepSeek-V3 in one gloo world (experts 4 + 4),
behind ``DPClient`` and behind ``tokenfab serve``: concurrent requests get one process's greedy
tokens, both replicas are used, and a killed replica takes the other down (the server answers 503).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from tests.distributed.engine_client import drain
from tokenfab.engine.requests.errors import EngineDeadError
from tokenfab.executors.dp_lockstep import Lockstep, validate_dp_ep


class StubMoE(torch.nn.Module):
    hidden_size = 6

    def __init__(self) -> None:
        super().__init__()
        self.rows: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.rows.append(x.shape[0])
        return x


class ThreadMax:
    """MAX all-reduce among ``n`` threads."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n)
        self.box: list[torch.Tensor | None] = [None] * n

    def for_rank(self, r: int):
        def reduce(t: torch.Tensor) -> None:
            self.box[r] = t.clone()
            self.barrier.wait(timeout=10)
            t.copy_(torch.stack(self.box).amax(dim=0))
            self.barrier.wait(timeout=10)
        return reduce


def test_lockstep_flags_and_the_empty_pass_keep_moe_calls_equal():
    comm = ThreadMax(2)
    moes = [[StubMoE(), StubMoE()] for _ in range(2)]
    locks = [Lockstep(comm.for_rank(r), moes[r], torch.device("cpu"), torch.float32) for r in range(2)]
    # rank 0: 3 requests' worth of steps (one ran no forward: nothing schedulable); rank 1: one step
    plans = [[2, 0, 2], [2]]
    results: list = [None, None]

    def forward(r: int, n: int):
        def run():
            if n:
                for m in moes[r]:
                    m(torch.zeros(n, StubMoE.hidden_size))
        return run

    def rank(r: int) -> None:
        todo, flags, calls = list(plans[r]), [], []
        while True:
            any_busy, any_stop = locks[r].sync(bool(todo), not todo and r == 1 and len(flags) > 4)
            flags.append((any_busy, any_stop))
            if any_stop:
                break
            if any_busy:
                calls.append(locks[r].step(forward(r, todo.pop(0))) if todo else locks[r].idle_pass())
        results[r] = (flags, calls)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert all(res is not None for res in results)
    flags0, calls0 = results[0]
    flags1, calls1 = results[1]
    assert flags0 == flags1  # every rank sees the same reduced flags
    # three busy rounds, two idle ones (no collective but the flags), then rank 1's stop stops both
    assert flags0 == [(True, False)] * 3 + [(False, False)] * 2 + [(False, True)]
    assert calls0 == [1, 0, 1] and calls1 == [1, None, None]  # rank 1 idled through rank 0's steps
    for r in range(2):  # both layers saw one call per step on both ranks: the all-to-alls meet
        assert [len(m.rows) for m in moes[r]] == [3, 3]
    assert moes[0][0].rows == [2, 0, 2] and moes[1][0].rows == [2, 0, 0]
    assert locks[1].idle_steps == 2 and locks[0].idle_steps == 1


def test_a_failed_flag_all_reduce_is_a_dead_engine():
    def broken(_t):
        raise RuntimeError("Connection closed by peer")

    lock = Lockstep(broken, [StubMoE()], torch.device("cpu"), torch.float32)
    with pytest.raises(EngineDeadError, match="peer replica is gone"):
        lock.sync(True, False)


def test_refused_options_name_themselves():
    from tokenfab.engine.args import EngineArgs

    with pytest.raises(ValueError, match="--tensor-parallel-size 2"):
        EngineArgs(data_parallel_size=2, enable_expert_parallel=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="--async-scheduling"):
        EngineArgs(data_parallel_size=2, enable_expert_parallel=True, async_scheduling=True)
    EngineArgs(data_parallel_size=2, tensor_parallel_size=2)  # plain DP with TP: unchanged
    validate_dp_ep(EngineArgs(data_parallel_size=1, enable_expert_parallel=True, tensor_parallel_size=2))


def test_one_dead_replica_is_all_dead_in_lockstep():
    from tokenfab.engine.core.dp_client import DPClient

    def fake():
        return SimpleNamespace(tokenizer=None, model_name="m", max_model_len=64, vocab_size=320, eos_token_ids=[],
                               kv_cache_tokens=64, scheduling_policy="fcfs", core_pid=1, on_dead=None,
                               close=lambda timeout=None: None)

    for lockstep, dead_after in ((True, True), (False, False)):
        client = DPClient([fake(), fake()], 4, lockstep=lockstep)
        died = []
        client.on_dead = died.append
        client.clients[1].on_dead(EngineDeadError("killed"))
        assert client.is_dead is dead_after and bool(died) is dead_after
        if lockstep:
            assert "replica 1 died" in client.dead[0]
        client.close()


# ---- slow: real replicas ------------------------------------------------------------------------
ENGINE_ARGS = dict(block_size=4, num_kv_blocks=14, max_num_batched_tokens=8, max_num_seqs=4)
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11], [5, 17, 42, 99, 3, 250, 7, 8, 1, 2],
           list(range(30, 52)), [7, 8], [1, 2, 3], list(range(100, 110))]
MAX_TOKENS = 8


def save_word_tokenizer(path, vocab_size: int = 320) -> None:
    """A word-level tokenizer ("t0" .. "t319", split on spaces): the served text names the token ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(path)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory) -> tuple[str, list[list[int]]]:
    from tests.models.test_deepseek import save_tiny_deepseek
    from tokenfab.engine.llm_engine import LLMEngine
    from tokenfab.engine.requests.sampling_params import SamplingParams

    path = tmp_path_factory.mktemp("deepseek_v3_dp_ep")
    save_tiny_deepseek(path)
    save_word_tokenizer(path)
    engine = LLMEngine(model=str(path), **ENGINE_ARGS)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    refs = []
    for i, p in enumerate(PROMPTS):  # one at a time: the single-process reference
        engine.add_request(f"ref{i}", list(p), params)
        while engine.has_unfinished_requests():
            for o in engine.step():
                if o.finished:
                    refs.append(list(o.outputs[0].token_ids))
    return str(path), refs


def _gone(pid: int, timeout: float) -> bool:
    from tokenfab.engine.core.process import pid_alive

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            if not pid_alive(pid):
                return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
def test_dp2_ep_replicas_give_one_process_tokens_and_die_together(deepseek):
    from tokenfab.engine.args import EngineArgs
    from tokenfab.engine.core.dp_client import DPClient
    from tokenfab.engine.requests.sampling_params import SamplingParams

    path, refs = deepseek
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    client = DPClient.spawn(EngineArgs(model=path, data_parallel_size=2, enable_expert_parallel=True,
                                       **ENGINE_ARGS))
    try:
        assert client.lockstep
        for i, p in enumerate(PROMPTS):  # all at once: both replicas get some
            client.add_request(f"r{i}", list(p), params)
        done = drain(client, {f"r{i}" for i in range(len(PROMPTS))})
        assert [list(done[f"r{i}"].outputs[0].token_ids) for i in range(len(PROMPTS))] == refs
        assert min(client.router.routed) >= 2, client.router.routed
        # one replica busy, the other idle (it runs the empty MoE pass): still one process's tokens
        client.add_request("solo", list(PROMPTS[2]), params)
        assert list(drain(client, {"solo"})["solo"].outputs[0].token_ids) == refs[2]
        # a replica dies: the other cannot go on (its collectives would hang): it exits, all dead
        long = SamplingParams(temperature=0, max_tokens=400, ignore_eos=True)
        client.add_request("long0", list(PROMPTS[0]), long)
        client.add_request("long1", list(PROMPTS[1]), long)
        client.step(200)
        survivor = client.clients[0].core_pid
        os.kill(client.clients[1].core_pid, signal.SIGKILL)
        done = drain(client, {"long0", "long1"}, timeout=60)
        assert set(done) == {"long0", "long1"}
        assert all(o.outputs[0].finish_reason == "error" for o in done.values())
        assert client.is_dead
        assert _gone(survivor, 30), "the surviving replica kept running"
        with pytest.raises(EngineDeadError):
            client.add_request("late", list(PROMPTS[0]), params)
    finally:
        client.close()


@pytest.mark.slow
def test_serve_dp2_ep_concurrent_requests_and_a_dead_replica_is_503(deepseek):
    import re
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from tests.server.test_cli_server import API_KEY, ServeProcess

    path, refs = deepseek
    flags = [f"--{k.replace('_', '-')}" if i == 0 else str(v) for k, v in ENGINE_ARGS.items() for i in range(2)]
    server = ServeProcess(path, "--data-parallel-size", "2", "--enable-expert-parallel", *flags, "--no-access-log")
    try:
        pids = [int(p) for p in re.search(r"engine core pid (\d+), (\d+)", server.output).groups()]
        with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {API_KEY}"}, timeout=600) as c:
            def complete(ids: list[int]) -> list[int]:
                body = {"prompt": ids, "max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True}
                r = c.post("/v1/completions", json=body)
                assert r.status_code == 200, r.text
                return [int(w[1:]) for w in r.json()["choices"][0]["text"].split()]

            with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrent: both replicas get some
                got = list(pool.map(complete, PROMPTS))
            assert got == refs
            for r in range(2):
                assert f"replica {r}: serving its first requests" in server.output, server.output[-3000:]
            os.kill(pids[1], signal.SIGKILL)  # the other cannot go on alone: it exits, the server is dead
            assert _gone(pids[0], 30), "the surviving replica kept running"
            deadline = time.monotonic() + 30
            while httpx.get(f"{server.url}/health").status_code == 200 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert httpx.get(f"{server.url}/health").status_code != 200
            r = c.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 2})
            assert r.status_code == 503, r.text
            assert "error" in r.json()
        assert "peer replica is gone" in server.output
    finally:
        server.stop()
