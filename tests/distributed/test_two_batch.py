"""Two-batch overlap (tokenfab/distributed/two_batch.py).

Fast tier (one process): the split of a mixed ForwardBatch (prefill chunks + decodes) into two
micro-batches of whole sequences and the recombination of their logits rows, against the plain
definition; and the overlapped forward of a tiny Llama whose row-parallel linears all-reduce through a
*fake* asynchronous collective (the reduce scales the tensor, applied only when ``wait()`` is called,
so a result read before its wait changes the tokens): the greedy tokens equal the plain path's, the
micro-batches interleave (B's compute runs between A's launch and A's wait), and a module that wrongly
claims to end in its only collective is refused.

Slow tier (2 gloo ranks, tests/distributed/launch.py): TP 2 on a tiny Llama and a tiny Qwen2-MoE
(TP-split experts + shared expert), EP 2 (and TP 2 + EP 2) on a tiny Qwen3-MoE, and the spawned-worker
launch path give the same greedy tokens with TBO as without and as one process, on mixed
batches (chunked prefill + decodes) with prefix caching and preemption on.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from tokenfab.distributed import parallel_state as ps
from tokenfab.distributed import two_batch
from tokenfab.forward_batch import ForwardBatch


def _mixed_batch(q_lens: list[int], ctx: list[int], sample: list[bool], block_size: int = 4) -> ForwardBatch:
    """A batch as ModelRunner.prepare builds it (sequence i's blocks are distinct, consecutive ids)."""
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    nblocks = [-(-c // block_size) for c in ctx]
    width = max(nblocks)
    tables, first = [], 1
    for nb in nblocks:
        tables.append(list(range(first, first + nb)) + [0] * (width - nb))
        first += nb
    positions = [p for n, c in zip(q_lens, ctx) for p in range(c - n, c)]
    seq_of = [i for i, n in enumerate(q_lens) for _ in range(n)]
    slots = [tables[i][p // block_size] * block_size + p % block_size for i, p in zip(seq_of, positions)]
    logits = [cu[i + 1] - 1 for i, s in enumerate(sample) if s]
    return ForwardBatch(
        input_ids=torch.arange(cu[-1], dtype=torch.int64) + 7,
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32),
        context_lens=torch.tensor(ctx, dtype=torch.int32),
        logits_indices=torch.tensor(logits, dtype=torch.int64),
        max_query_len=max(q_lens), max_context_len=max(ctx),
        prompt_indices=torch.tensor([0, 1, 2, cu[3], cu[3] + 1], dtype=torch.int64) if len(q_lens) > 3 else None,
    )


def test_split_batch_mixed_and_recombined():
    # a prefill chunk (sampled only at its end: not sampled here), decodes, a whole prompt, decodes
    q_lens, ctx = [9, 1, 1, 12, 1, 3], [9, 20, 7, 12, 33, 10]
    sample = [False, True, True, True, True, True]
    batch = _mixed_batch(q_lens, ctx, sample)
    cu = batch.cu_seqlens_q.tolist()
    s = two_batch.split_point(cu)
    assert s == 3  # boundaries 9, 10, 11, 23, 24 of 27 tokens: 11 is nearest 13.5
    a, b = two_batch.split_batch(batch)
    for mb, lo, hi in ((a, 0, s), (b, s, len(q_lens))):
        t0, t1 = cu[lo], cu[hi]
        assert torch.equal(mb.input_ids, batch.input_ids[t0:t1])
        assert torch.equal(mb.positions, batch.positions[t0:t1])
        assert torch.equal(mb.slot_mapping, batch.slot_mapping[t0:t1])
        assert torch.equal(mb.block_tables, batch.block_tables[lo:hi])
        assert mb.cu_seqlens_q.tolist() == [c - t0 for c in cu[lo:hi + 1]]
        assert mb.context_lens.tolist() == ctx[lo:hi]
        assert mb.max_query_len == max(q_lens[lo:hi]) and mb.max_context_len == max(ctx[lo:hi])
        # each micro-batch's logits rows: its sampled sequences' last tokens, relative to its first token
        assert mb.logits_indices.tolist() == [cu[i + 1] - 1 - t0 for i in range(lo, hi) if sample[i]]
    assert b.max_query_len == 12 and a.max_query_len == 9
    assert torch.equal(two_batch.merge_indices(a, b, a.num_tokens), batch.logits_indices)
    assert torch.equal(torch.cat((a.prompt_indices, b.prompt_indices + a.num_tokens)), batch.prompt_indices)
    assert ForwardBatch.latest() is batch  # micro-batches are views of the step's batch
    with pytest.raises(ValueError, match="at least two sequences"):
        two_batch.split_point([0, 5])
    assert two_batch.split_point([0, 1, 100]) == 1 and two_batch.split_point([0, 100, 101]) == 1


class FakeWork:
    def __init__(self, x: torch.Tensor, log: list) -> None:
        self.x, self.log, self.done = x, log, False

    def wait(self) -> bool:
        if not self.done:
            self.x.mul_(FAKE_SCALE)
            self.done = True
            self.log.append(("wait", id(self.x)))
        return True


FAKE_SCALE = 1.5


@pytest.fixture
def fake_tp2(monkeypatch):
    """``activate()``: TP size 2 for the parallel layers' all-reduce from then on, with a fake
    collective: x *= 1.5 (at once, or at wait() under async_op). Models are built (at TP 1) before,
    their row-parallel linears then switched to reduce. Yields (activate, the event log)."""
    log: list = []

    def fake_all_reduce(x, group=None, async_op=False):
        log.append(("launch" if async_op else "sync", id(x)))
        if async_op:
            return FakeWork(x, log)
        x.mul_(FAKE_SCALE)
        return None

    def activate() -> None:
        monkeypatch.setattr(dist, "all_reduce", fake_all_reduce)
        monkeypatch.setattr(ps.get_parallel_state(), "tp_size", 2)

    yield activate, log
    two_batch.configure(False)


def _tiny_llama_engine(path: str, tbo: bool):
    from tokenfab.engine.llm_engine import LLMEngine
    from tokenfab.models.llama import LlamaAttention, LlamaMLP

    engine = LLMEngine(model=path, block_size=4, num_kv_blocks=40, max_num_batched_tokens=24, max_num_seqs=4,
                       enable_two_batch_overlap=tbo, tbo_min_tokens=6)
    for m in engine.model.modules():
        if isinstance(m, LlamaAttention):
            m.o_proj.reduce_output = True
        elif isinstance(m, LlamaMLP):
            m.down_proj.reduce_output = True
    return engine


PROMPTS = [list(range(5, 35)), [7, 8, 9], list(range(100, 117)), [40, 41, 42, 43, 44]]
ARRIVALS = [0, 0, 2, 3]


def test_overlap_one_process_fake_collectives(tmp_path, fake_tp2):
    """The overlapped path's greedy tokens equal the plain path's, on mixed steps (a 30-token prompt
    chunked at 24 tokens a step, decodes, later prompts joining)."""
    from tests.tiny_models import run_batch, save_tiny_model, tiny_config

    save_tiny_model(tiny_config("llama"), tmp_path)
    activate, log = fake_tp2
    plain = _tiny_llama_engine(str(tmp_path), tbo=False)
    engine = _tiny_llama_engine(str(tmp_path), tbo=True)
    activate()
    two_batch.configure(False)  # the switch is per process (the last engine built set it)
    ref, _, _ = run_batch(plain, PROMPTS, 6, ARRIVALS, logprobs=0)
    assert log and all(kind == "sync" for kind, _ in log)  # plain: every all-reduce synchronous
    log.clear()
    two_batch.configure(True, 6)
    calls = []
    orig = two_batch.forward

    def spy(model, batch):
        calls.append((batch.num_seqs, batch.num_tokens, int(batch.max_query_len)))
        return orig(model, batch)

    two_batch.forward = spy
    try:
        tokens, _, batches = run_batch(engine, PROMPTS, 6, ARRIVALS, logprobs=0)
    finally:
        two_batch.forward = orig
    assert tokens == ref
    # overlapped steps happened, mixed ones among them (a prefill chunk beside decodes), small ones not
    assert calls and any(q > 1 and n > 1 for n, _, q in calls)
    assert len(calls) == sum(1 for b in batches if b.num_seqs >= 2 and b.num_tokens >= 6)
    # interleaving: some micro-batch launched its all-reduce between another's launch and its wait
    launched, overlapped = [], 0
    for kind, x in log:
        if kind == "launch":
            launched.append(x)
        elif kind == "wait":
            overlapped += launched[-1] != x
    assert overlapped > 0
    assert sum(k == "launch" for k, _ in log) == sum(k == "wait" for k, _ in log)  # every launch waited
    assert any(k == "sync" for k, _ in log)  # steps below the threshold or of one sequence: plain


def test_deferred_call_with_two_collectives_refused(fake_tp2):
    fake_tp2[0]()
    class TwoReduces(torch.nn.Module):
        ends_in_all_reduce = True  # wrong: its first reduce's result is read inside

        def forward(self, x):
            return ps.tp_all_reduce(ps.tp_all_reduce(x) + 1)

    def stages(x):
        return (yield from two_batch.call(TwoReduces(), x))

    with pytest.raises(RuntimeError, match="2 collectives"):
        two_batch.run_overlapped(stages(torch.ones(2)), stages(torch.ones(2)))
    # outside an overlapped step the same call is plain (synchronous collectives, no yield)
    assert torch.equal(two_batch.run_plain(stages(torch.ones(2))), torch.full((2,), (1.5 + 1) * 1.5))


def test_model_allows():
    class Shared(torch.nn.Module):
        tbo_unsafe = True

    class Cache(torch.nn.Module):
        kv_calibrate = False

    ok = torch.nn.Sequential(torch.nn.Linear(2, 2), Cache())
    assert two_batch.model_allows(ok)
    ok[1].kv_calibrate = True  # an FP8 KV layer still calibrating on its first batch
    assert not two_batch.model_allows(ok)
    assert not two_batch.model_allows(torch.nn.Sequential(torch.nn.Linear(2, 2), Shared()))
    from tokenfab.layers.dsa import SparseLatentAttention

    assert SparseLatentAttention.tbo_unsafe  # DSA layers share the previous layer's top-k indices


def test_configure_and_switch():
    batch = _mixed_batch([4, 4], [4, 4], [True, True])
    try:
        two_batch.configure(True, 8)
        assert not two_batch.wanted(batch)  # TP 1, EP 1: nothing to overlap
        with pytest.raises(ValueError, match="tbo-min-tokens"):
            two_batch.configure(True, 1)
    finally:
        two_batch.configure(False)
    from tokenfab.engine.args import EngineArgs

    cfg = two_batch.configure_from_args(EngineArgs(enable_two_batch_overlap=True))
    assert cfg.enabled and cfg.min_tokens == two_batch.DEFAULT_MIN_TOKENS
    two_batch.configure(False)


# ------------------------------------------------------------------ slow tier: gloo ranks

TP_ENGINE = dict(block_size=4, num_kv_blocks=26, max_num_batched_tokens=16, max_num_seqs=4, seed=0)


def _count_overlapped() -> tuple[list, object]:
    calls: list = []
    orig = two_batch.forward

    def spy(model, batch):
        calls.append(batch.num_tokens)
        return orig(model, batch)

    two_batch.forward = spy
    return calls, orig


def _tp_rank(rank: int, tp: int, model: str, engine_kwargs: dict) -> dict:
    from tests.distributed.test_tp_models import generate

    ps.init_parallel(tp)
    calls, orig = _count_overlapped()
    try:
        out = generate(model, engine_kwargs)
    finally:
        two_batch.forward = orig
        two_batch.configure(False)
    return {"tokens": out["tokens"], "sampled": out["sampled"], "overlapped": len(calls),
            "deferred": two_batch.stats["deferred_collectives"],
            "preemptions": out["preemptions"], "prefix_hits": out["prefix_hits"], "chunked": out["chunked"]}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen2_moe", "deepseek_v3"])
def test_tp2_tbo_equals_plain_and_one_process(tmp_path, arch):
    """TP 2: tiny Llama, tiny Qwen2-MoE without EP (experts split by TP: their all-reduce is a
    yield point, the gated shared expert added after it; dense layers between), tiny DeepSeek-V3
    (MLA heads split: o_proj's all-reduce a yield point; shared experts)."""
    from tests.distributed.launch import run_ranks
    from tests.distributed.test_tp_models import generate
    from tests.moe_tiny_models import tiny_moe_config
    from tests.tiny_models import save_tiny_model, tiny_config

    if arch == "deepseek_v3":
        from tests.models.test_deepseek import save_tiny_deepseek

        save_tiny_deepseek(tmp_path)
    else:
        save_tiny_model(tiny_config("llama") if arch == "llama" else tiny_moe_config(arch), tmp_path)
    one = generate(str(tmp_path), TP_ENGINE)
    tbo = dict(TP_ENGINE, enable_two_batch_overlap=True, tbo_min_tokens=4)
    plain = run_ranks(_tp_rank, 2, 2, str(tmp_path), TP_ENGINE)
    over = run_ranks(_tp_rank, 2, 2, str(tmp_path), tbo)
    for p, o in zip(plain, over):
        assert o["tokens"] == p["tokens"] == one["tokens"]
        assert o["sampled"] == p["sampled"] == one["sampled"]
        assert p["overlapped"] == 0 and o["overlapped"] > 0
        assert p["deferred"] == 0 and o["deferred"] >= o["overlapped"] * 2 * 2 * 2  # 2 layers x 2 reduces x 2 halves
        assert o["preemptions"] > 0 and o["prefix_hits"] > 0 and o["chunked"]


def _ep_rank(rank: int, path: str, tp: int, tbo: bool) -> dict:
    from tests.distributed.test_expert_parallel import ENGINE_ARGS, PROMPTS, _generate
    from tokenfab.distributed import ep_dispatch
    from tokenfab.engine.llm_engine import LLMEngine

    torch.set_num_threads(1)
    ps.init_parallel(tp)
    ps.init_expert_parallel(True, 2)
    ep_dispatch.set_ep_mode("auto", capacity=ENGINE_ARGS["max_num_seqs"] // tp)
    engine = LLMEngine(model=path, **ENGINE_ARGS, enable_two_batch_overlap=tbo, tbo_min_tokens=4)
    calls, orig = _count_overlapped()
    try:
        first, pre1 = _generate(engine, PROMPTS[:2])
        tokens, pre2 = _generate(engine, PROMPTS)
    finally:
        two_batch.forward = orig
        two_batch.configure(False)
    return {"tokens": first + tokens, "preempted": pre1 + pre2, "overlapped": len(calls),
            "deferred": two_batch.stats["deferred_collectives"]}


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_ep2_qwen3_moe_tbo_equals_plain_and_one_process(tmp_path, tp):
    from tests.distributed.launch import run_ranks
    from tests.distributed.test_expert_parallel import ENGINE_ARGS, PROMPTS, _generate
    from tests.moe_tiny_models import tiny_moe_config
    from tests.tiny_models import save_tiny_model
    from tokenfab.engine.llm_engine import LLMEngine

    save_tiny_model(tiny_moe_config("qwen3_moe"), tmp_path)
    ref_engine = LLMEngine(model=str(tmp_path), **ENGINE_ARGS)
    first, _ = _generate(ref_engine, PROMPTS[:2])
    tokens, _ = _generate(ref_engine, PROMPTS)
    ref = first + tokens
    plain = run_ranks(_ep_rank, 2, str(tmp_path), tp, False)
    over = run_ranks(_ep_rank, 2, str(tmp_path), tp, True)
    for p, o in zip(plain, over):
        assert o["tokens"] == p["tokens"] == ref
        assert p["overlapped"] == 0 and o["overlapped"] > 0 and o["preempted"] > 0
        # every overlapped step launched its all-to-alls (and at TP 2 its all-reduces) asynchronously
        assert p["deferred"] == 0 and o["deferred"] >= o["overlapped"] * 2 * 3


@pytest.mark.slow
def test_tp2_spawned_workers_with_tbo_same_tokens_as_one_process(tmp_path):
    """The launch path: ``LLM(tensor_parallel_size=2, enable_two_batch_overlap=True)``; the spawned
    worker configures TBO from the same EngineArgs (else the collectives would not pair up)."""
    from tests.distributed.test_tp_launch import STRESS, _prompts, _run
    from tests.tiny_models import save_tiny_model, tiny_config
    from tokenfab import LLM

    save_tiny_model(tiny_config("llama"), tmp_path)
    prompts = _prompts(320)
    one = LLM(str(tmp_path), **STRESS)
    expected, reached = _run(one, prompts, 8)
    del one
    before = dict(two_batch.stats)
    tp = LLM(str(tmp_path), tensor_parallel_size=2, enable_two_batch_overlap=True, tbo_min_tokens=4, **STRESS)
    try:
        got, reached_tp = _run(tp, prompts, 8)
        assert tp.engine.tp.dead is None
    finally:
        tp.shutdown()
        two_batch.configure(False)
    assert got == expected and reached_tp == reached
    assert two_batch.stats["overlapped_steps"] > before["overlapped_steps"]
    assert two_batch.stats["deferred_collectives"] > before["deferred_collectives"]
