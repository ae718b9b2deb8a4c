"""Expert parallelism: dispatch/combine (tokenfab/distributed/ep_dispatch.py) and FusedMoE under EP.

Fast tier: one process, the EP ranks as threads exchanging through an in-memory all-to-all; each
rank's dispatch + combine equals the single-process sum over its tokens' k experts *bit for bit*
when the expert products are row-invariant (one M=1 product per row, so a row's result does not
depend on which rows share its expert), in both modes and with EPLB replicas; the bytes it sends
match the routing and ``tokenfab plan``'s expected remote-rank count.

Slow tier (gloo processes, tests/distributed/launch.py): FusedMoE with EP 2 (and TP 2 + EP 2 in a
world of 4) against one process, exact under row-invariant products; rebalance() keeps the output;
whole tiny Qwen3-MoE, Mixtral, GPT-OSS and DeepSeek-V3 models give one process's greedy tokens
(prefix caching, chunked prefill and preemption on), normal and low-latency modes, EPLB replicas on;
the all-to-all bytes per token measured by CommCounter vs the plan's EP figure.
"""

from __future__ import annotations

import threading

import pytest
import torch
import torch.nn.functional as F

from tokenfab.distributed import ep_dispatch
from tokenfab.distributed.eplb import rebalance_experts, select_replica
from tokenfab.planner.plan import expected_remote_ranks

H, I = 16, 8


class ThreadAllToAll:
    """``all_to_all_single`` among ``ep`` threads of one process; counts each rank's remote bytes."""

    def __init__(self, ep: int) -> None:
        self.ep = ep
        self.barrier = threading.Barrier(ep)
        self.box: list[list[torch.Tensor] | None] = [None] * ep
        self.sent: list[dict[str, int]] = [{} for _ in range(ep)]

    def for_rank(self, rank: int):
        def a2a(x, send_splits=None, recv_splits=None, kind="all_to_all"):
            splits = send_splits if send_splits is not None else [x.shape[0] // self.ep] * self.ep
            chunks = list(torch.split(x, splits))
            row = x.element_size() * int(torch.tensor(x.shape[1:]).prod())
            remote = sum(splits) - splits[rank]
            self.sent[rank][kind] = self.sent[rank].get(kind, 0) + remote * row
            self.box[rank] = chunks
            self.barrier.wait()
            out = torch.cat([self.box[s][rank] for s in range(self.ep)])
            self.barrier.wait()
            if recv_splits is not None:
                assert out.shape[0] == sum(recv_splits)
            return out
        return a2a


def rowwise_experts(w13: torch.Tensor, w2: torch.Tensor):
    """expert_fn over stacked [L, 2I, H] / [L, H, I] weights: one M=1 product per row (row-invariant)."""
    def fn(x, w, ids):
        out = x.new_empty(x.shape)
        for r in range(x.shape[0]):
            e = int(ids[r, 0])
            g, u = F.linear(x[r:r + 1], w13[e]).chunk(2, dim=-1)
            out[r] = (F.linear(F.silu(g) * u, w2[e]) * w[r]).to(x.dtype)[0]
        return out
    return fn


def single_process(x, ids, w, w13, w2):
    """The one-process layer: every (token, slot) pair through its logical expert, summed in slot order."""
    t, k = ids.shape
    pairs = rowwise_experts(w13, w2)(x.repeat_interleave(k, 0), w.reshape(-1, 1), ids.reshape(-1, 1))
    return pairs.view(t, k, x.shape[1]).float().sum(dim=1).to(x.dtype)


def run_threads(ep: int, fn, comm: ThreadAllToAll) -> list:
    results: list = [None] * ep
    errors: list = []

    def target(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append((r, e))
            comm.barrier.abort()  # the other ranks stop waiting

    threads = [threading.Thread(target=target, args=(r,)) for r in range(ep)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    if errors:
        errors.sort(key=lambda re: isinstance(re[1], threading.BrokenBarrierError))  # the cause first
        raise errors[0][1]
    return results


def _routing(g, t, e, k):
    """Distinct top-k ids per token (uniform) and positive weights."""
    ids = torch.argsort(torch.rand(t, e, generator=g), dim=1)[:, :k].to(torch.int32)
    w = torch.rand(t, k, generator=g) + 0.1
    return ids, w


@pytest.mark.parametrize("mode", ["normal", "low_latency", "low_latency_static"])
@pytest.mark.parametrize("ep,experts,redundant,k", [(2, 8, 0, 2), (4, 8, 4, 3)])
def test_dispatch_combine_bit_identical(monkeypatch, mode, ep, experts, redundant, k):
    if mode == "low_latency_static":  # the CUDA-graph path: every slot row through the experts
        monkeypatch.setattr(ep_dispatch, "STATIC_ON_CPU", True)
        mode = "low_latency"
    g = torch.Generator().manual_seed(ep * 10 + redundant)
    w13 = torch.randn(experts, 2 * I, H, generator=g)
    w2 = torch.randn(experts, H, I, generator=g)
    load = torch.rand(experts, generator=g) * 100
    pl = rebalance_experts(load, ep, redundant)
    tokens = [5, 0, 9, 3][:ep]  # ragged, one rank with no tokens
    xs = [torch.randn(t, H, generator=g) for t in tokens]
    routes = [_routing(g, t, experts, k) for t in tokens]
    comm = ThreadAllToAll(ep)
    capacity = max(tokens)

    def rank_fn(r):
        local = pl.local_logical(r)
        fn = rowwise_experts(w13[local], w2[local])
        ids, w = routes[r]
        phys = select_replica(ids, pl.log2phy, pl.logcnt)
        return ep_dispatch.dispatch_combine(xs[r], phys, w, fn, ep, pl.num_local, mode, capacity,
                                            a2a=comm.for_rank(r))

    outs = run_threads(ep, rank_fn, comm)
    for r in range(ep):
        ids, w = routes[r]
        ref = single_process(xs[r], ids, w, w13, w2)
        assert outs[r].shape == (tokens[r], H)
        assert torch.equal(outs[r], ref), f"rank {r}: max diff {(outs[r] - ref).abs().max()}"
    # bytes: normal mode sends a token row once to each other rank holding one of its experts and
    # every remote pair's output back; low latency moves the whole padded buffer both ways
    if mode == "normal":
        for r in range(ep):
            ids, _ = routes[r]
            dest = select_replica(ids, pl.log2phy, pl.logcnt).long() // pl.num_local
            copies = sum(len(set(row.tolist()) - {r}) for row in dest)
            assert comm.sent[r]["dispatch"] == copies * H * 4
        remote_pairs = sum(int((select_replica(routes[r][0], pl.log2phy, pl.logcnt).long() // pl.num_local
                                != r).sum()) for r in range(ep))
        assert sum(c["combine"] for c in comm.sent) == remote_pairs * H * 4
    else:
        rows = (ep - 1) * pl.num_local * capacity
        assert all(c["dispatch_ll"] == rows * H * 4 and c["combine_ll"] == rows * H * 4 for c in comm.sent)


def test_low_latency_refuses_overflow():
    with pytest.raises(ValueError, match="at most 2 tokens"):
        ep_dispatch.low_latency(torch.zeros(3, H), torch.zeros(3, 1, dtype=torch.int32), torch.ones(3, 1),
                                lambda x, w, i: x, 2, 2, 2, a2a=lambda x, *a, **kw: x)
    with pytest.raises(ValueError, match="mode must be one of"):
        ep_dispatch.set_ep_mode("fast")


def test_dispatch_bytes_match_plan_expected_ranks():
    """Uniform routing of 16 experts (top 4) over 4 ranks: the rows each rank sends per token equal
    plan's expected number of other ranks a token visits, within 5% (seeded: 4 x 256 tokens, about 4
    standard errors)."""
    ep, experts, k, t = 4, 16, 4, 256
    g = torch.Generator().manual_seed(1)
    pl = rebalance_experts(torch.ones(experts), ep, 0)
    w13, w2 = torch.zeros(pl.num_local, 2 * I, H), torch.zeros(pl.num_local, H, I)
    routes = [_routing(g, t, experts, k) for _ in range(ep)]
    comm = ThreadAllToAll(ep)

    def rank_fn(r):
        ids, w = routes[r]
        phys = select_replica(ids, pl.log2phy, pl.logcnt)
        fn = lambda x, w_, i: x  # noqa: E731 - the bytes do not depend on the experts
        return ep_dispatch.normal(torch.randn(t, H), phys, w, fn, ep, pl.num_local, a2a=comm.for_rank(r))

    run_threads(ep, rank_fn, comm)
    del w13, w2
    per_token = sum(c["dispatch"] for c in comm.sent) / (ep * t) / (H * 4)
    assert per_token == pytest.approx(expected_remote_ranks(experts, k, ep), rel=0.05)


# ---------------------------------------------------------------- gloo processes (slow tier)

E_LAYER, K_LAYER, T_LAYER = 8, 2, 24


class _RowwiseF:
    """torch.nn.functional with a row-invariant ``linear`` (one M=1 product per row): patched into the
    CPU fused-experts reference so that EP and one process compute each pair identically."""

    def __getattr__(self, name):
        return getattr(F, name)

    @staticmethod
    def linear(x, w, b=None):
        rows = [F.linear(x[r:r + 1], w, b) for r in range(x.shape[0])]
        return torch.cat(rows) if rows else F.linear(x, w, b)


def _layer_rank(rank: int, tp: int, ep_on: bool, redundant: int, mode: str) -> dict:
    from tokenfab.distributed import parallel_state as ps
    from tokenfab.kernels import moe_gemm
    from tokenfab.layers.moe import FusedMoE

    torch.set_num_threads(1)
    ps.init_parallel(tp)
    ps.init_expert_parallel(ep_on, redundant)
    ep_dispatch.set_ep_mode(mode, capacity=T_LAYER)
    moe_gemm.F = _RowwiseF()
    g = torch.Generator().manual_seed(0)  # the same full weights and tokens on every rank (SPMD)
    w13 = torch.randn(E_LAYER, 2 * I, H, generator=g)
    w2 = torch.randn(E_LAYER, H, I, generator=g)
    b2 = torch.randn(E_LAYER, H, generator=g)
    gate = torch.randn(E_LAYER, H, generator=g) * 0.3
    x = torch.randn(T_LAYER, H, generator=g)
    moe = FusedMoE(H, I, E_LAYER, K_LAYER, expert_bias=True)
    moe.gate.weight.data.copy_(gate)
    done = []
    for e in range(E_LAYER):  # per expert, full-size tensors: the layer keeps its slots / its slice
        done += moe.load_expert_weight("gate", w13[e, :I], e) + moe.load_expert_weight("up", w13[e, I:], e)
        done += moe.load_expert_weight("down", w2[e], e) + moe.load_expert_weight("down_bias", b2[e], e)
        done += moe.load_expert_weight("gate_bias", torch.zeros(I), e)
        done += moe.load_expert_weight("up_bias", torch.zeros(I), e)
    counter = ps.CommCounter()
    ps.set_comm_counter(counter)
    out = moe(x)
    ps.set_comm_counter(None)
    weights, ids = moe.route(x)
    ref = moe_gemm.fused_experts_ref(x, w13, w2, weights, ids, torch.zeros(E_LAYER, 2 * I), b2)
    res = {"done": sorted(done), "exact": bool(torch.equal(out, ref)), "diff": float((out - ref).abs().max()),
           "rel": float((out - ref).abs().max() / ref.abs().max()),
           "num_local": moe.num_local_experts, "calls": counter.calls, "load": moe.expert_load.tolist(),
           "remote_copies": None}
    if moe.placement is not None:
        st = ps.get_parallel_state()
        chunk = -(-T_LAYER // tp)
        mine = ids[st.tp_rank * chunk:(st.tp_rank + 1) * chunk]
        phys = select_replica(mine, moe.log2phy, moe.logcnt).long()
        dest = phys // moe.num_local_experts
        res["remote_copies"] = sum(len(set(row.tolist()) - {st.ep_rank}) for row in dest)
        res["before"] = moe.placement.phy2log.tolist()
        res["after"] = moe.rebalance().phy2log.tolist()
        out2 = moe(x)
        res["exact_after_rebalance"] = bool(torch.equal(out2, ref))
    return res


@pytest.mark.slow
@pytest.mark.parametrize("world,tp,ep_on,redundant,mode", [
    (2, 1, True, 2, "normal"), (2, 1, True, 2, "low_latency"), (2, 2, True, 0, "auto"), (2, 2, False, 0, "auto"),
    (4, 2, True, 4, "auto"),
])
def test_fused_moe_layer_across_processes(world, tp, ep_on, redundant, mode):
    """EP 2 (EPLB 2 redundant experts), TP 2 + EP 2, TP 2 without EP, and a world of 4 (TP 2 x DP 2,
    EP 4, 4 redundant): the layer equals one process, bit for bit with EP (row-invariant products),
    within float32 rounding for the TP split (partial sums all-reduced); rebalance() from the
    measured load moves the weights and keeps the output."""
    from tests.distributed.launch import run_ranks

    res = run_ranks(_layer_rank, world, tp, ep_on, redundant, mode)
    for r in res:
        assert set(r["done"]) == {"w13_weight", "w2_weight", "w13_bias", "w2_bias"}  # every local slot loaded
        if ep_on:
            assert r["exact"], r["diff"]
            assert r["num_local"] == (E_LAYER + redundant) // world
            assert r["exact_after_rebalance"]
            assert r["after"] != r["before"] or redundant == 0
        else:
            assert r["rel"] < 1e-6 and r["num_local"] == E_LAYER  # float32 rounding of the partial sums
            assert [k for k, _ in r["calls"]] == ["all_reduce"]
    if ep_on and mode == "normal":
        for r in res:
            sent = dict.fromkeys(("dispatch", "combine", "count_exchange"), 0)
            for k, b in r["calls"]:
                sent[k] = sent.get(k, 0) + b
            assert sent["dispatch"] == r["remote_copies"] * H * 4  # a row once per other rank it visits
            assert sent["count_exchange"] == 8 * (world - 1)  # one int64 to each other rank
    if ep_on:  # the load counters saw every pair each rank routed (SPMD: its TP share of the tokens)
        assert sum(sum(r["load"]) for r in res) == world * (T_LAYER // tp) * K_LAYER


def _moe_model_paths(tmp_path_factory) -> dict:
    from tests.models.test_deepseek import save_tiny_deepseek
    from tests.moe_tiny_models import tiny_moe_config
    from tests.tiny_models import save_tiny_model

    paths = {}
    for case in ("qwen3_moe", "mixtral", "gpt_oss"):
        p = tmp_path_factory.mktemp(case)
        save_tiny_model(tiny_moe_config(case), p)
        paths[case] = str(p)
    p = tmp_path_factory.mktemp("deepseek_v3")
    save_tiny_deepseek(p)
    paths["deepseek_v3"] = str(p)
    return paths


# shared prefixes (prefix-cache hits), a long prompt (chunked prefill at 8 tokens a step) and 14 KV
# blocks of 4 tokens for 4 requests of up to 30 tokens (preemption)
ENGINE_ARGS = dict(block_size=4, num_kv_blocks=14, max_num_batched_tokens=8, max_num_seqs=4)
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11], [5, 17, 42, 99, 3, 250, 7, 8, 1, 2],
           list(range(30, 52)), [7, 8]]
MAX_TOKENS = 8


def _generate(engine, prompts) -> tuple[list[list[int]], int]:
    from tokenfab.engine.requests.sampling_params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", list(p), params)
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = list(o.outputs[0].token_ids)
    return [done[f"r{i}"] for i in range(len(prompts))], engine.scheduler.num_preemptions_total


def _model_rank(rank: int, path: str, tp: int, redundant: int, mode: str) -> dict:
    from tokenfab.distributed import parallel_state as ps
    from tokenfab.engine.llm_engine import LLMEngine
    from tokenfab.layers.moe import FusedMoE

    torch.set_num_threads(1)
    ps.init_parallel(tp)
    ps.init_expert_parallel(True, redundant)
    # auto: decode-sized batches (max_num_seqs tokens, split over the TP ranks) low-latency, prefill
    # chunks normal; forced low-latency: capacity for the largest step
    cap = ENGINE_ARGS["max_num_batched_tokens"] if mode == "low_latency" else ENGINE_ARGS["max_num_seqs"] // tp
    ep_dispatch.set_ep_mode(mode, capacity=cap)
    engine = LLMEngine(model=path, **ENGINE_ARGS)
    counter = ps.CommCounter()
    ps.set_comm_counter(counter)
    first, preempted = _generate(engine, PROMPTS[:2])  # the second request hits the first's prefix
    tokens, preempted2 = _generate(engine, PROMPTS)
    ps.set_comm_counter(None)
    moes = [m for m in engine.runner.model.modules() if isinstance(m, FusedMoE)]
    kinds = sorted({k for k, _ in counter.calls})
    return {"tokens": first + tokens, "preempted": preempted + preempted2, "kinds": kinds,
            "local": [m.num_local_experts for m in moes], "replicas": [int(m.logcnt.max()) for m in moes]}


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory):
    from tokenfab.engine.llm_engine import LLMEngine

    paths = _moe_model_paths(tmp_path_factory)
    refs = {}
    for case, path in paths.items():
        engine = LLMEngine(model=path, **ENGINE_ARGS)
        first, _ = _generate(engine, PROMPTS[:2])
        tokens, _ = _generate(engine, PROMPTS)
        refs[case] = first + tokens
    return paths, refs


MODEL_RUNS = [("qwen3_moe", 1, 2, "auto"), ("mixtral", 1, 2, "auto"), ("gpt_oss", 1, 2, "auto"),
              ("deepseek_v3", 1, 2, "auto"), ("qwen3_moe", 1, 0, "normal"), ("deepseek_v3", 1, 0, "low_latency"),
              ("qwen3_moe", 2, 2, "auto"), ("deepseek_v3", 2, 0, "auto")]


@pytest.mark.slow
@pytest.mark.parametrize("case,tp,redundant,mode", MODEL_RUNS)
def test_moe_model_greedy_tokens_match_one_process(moe_models, case, tp, redundant, mode):
    """2 gloo ranks, each running the same requests (SPMD) with the MoE layers expert-parallel over
    both (TP 2 + EP 2 where tp is 2: the TP ranks split the tokens): the same greedy tokens as one
    process, with prefix caching, chunked prefill and preemption on."""
    from tests.distributed.launch import run_ranks

    paths, refs = moe_models
    res = run_ranks(_model_rank, 2, paths[case], tp, redundant, mode)
    experts = {"qwen3_moe": 8, "mixtral": 8, "gpt_oss": 8, "deepseek_v3": 8}[case]
    for r in res:
        assert r["tokens"] == refs[case]
        assert r["preempted"] > 0
        assert set(r["local"]) == {(experts + redundant) // 2}
        if redundant:
            assert max(r["replicas"]) == 2
        want = {"normal": {"dispatch", "combine"}, "low_latency": {"dispatch_ll", "combine_ll"},
                "auto": {"dispatch", "combine", "dispatch_ll", "combine_ll"}}[mode]
        assert want <= set(r["kinds"]), r["kinds"]


def _bytes_rank(rank: int, experts: int, k: int, tokens: int) -> dict:
    from tokenfab.distributed import parallel_state as ps
    from tokenfab.layers.moe import FusedMoE

    torch.set_num_threads(1)
    ps.init_parallel(1)
    ps.init_expert_parallel(True)
    ep_dispatch.set_ep_mode("normal")
    g = torch.Generator().manual_seed(rank)  # each rank its own tokens (attention-DP-like)
    moe = FusedMoE(H, I, experts, k)
    for p in (moe.gate.weight, moe.w13_weight, moe.w2_weight):
        p.data.copy_(torch.randn(p.shape, generator=g) * 0.1)
    x = torch.randn(tokens, H, generator=g)
    counter = ps.CommCounter()
    ps.set_comm_counter(counter)
    moe(x)
    ps.set_comm_counter(None)
    _, ids = moe.route(x)
    remote_pairs = int((ids.long() // moe.num_local_experts != ps.get_parallel_state().ep_rank).sum())
    sent: dict[str, int] = {}
    for kind, b in counter.calls:
        sent[kind] = sent.get(kind, 0) + b
    return {"sent": sent, "remote_pairs": remote_pairs}


@pytest.mark.slow
def test_ep_bytes_per_token_vs_plan(tmp_path):
    """Normal-mode EP 2, 16 experts top 4, 512 tokens a rank: the dispatch bytes per token equal
    ``tokenfab plan``'s dispatch half (expected remote ranks x H x 4 bytes) within 10%; the combine
    returns one row per remote (token, expert) pair (the exact slot-order sum at home), so it sends
    k/2 = 2 rows a token where plan (DeepEP's per-rank reduced combine) counts 0.96."""
    from tests.distributed.launch import run_ranks
    from tests.planner.plan_configs import write_config
    from tokenfab.planner.hardware import get_gpu, parse_interconnect
    from tokenfab.planner.model_spec import build_spec, load_config
    from tokenfab.planner.plan import PlanRequest, plan_model

    experts, k, tokens = 16, 4, 512
    res = run_ranks(_bytes_rank, 2, experts, k, tokens)
    config = dict(model_type="qwen3_moe", hidden_size=H, intermediate_size=32, moe_intermediate_size=I,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=8, num_experts=experts,
                  num_experts_per_tok=k, decoder_sparse_step=1, mlp_only_layers=[], vocab_size=64,
                  torch_dtype="float32")
    gpu = get_gpu("h100")
    plan = plan_model(build_spec(load_config(write_config(tmp_path, config))),
                      PlanRequest(gpus=2, gpu=gpu, interconnect=parse_interconnect(None, gpu), context=64,
                                  max_num_seqs=8, dtype="float32"))
    ep2 = next(p for p in plan.layouts if p.layout == "TP1 DP2 EP2")
    assert ep2.decode_comm_bytes_per_token == pytest.approx(2 * expected_remote_ranks(experts, k, 2) * H * 4)
    for r in res:
        dispatch = r["sent"]["dispatch"] / tokens
        assert dispatch == pytest.approx(ep2.decode_comm_bytes_per_token / 2, rel=0.10)
        assert r["sent"]["count_exchange"] == 8
    # a rank's combine returns the other rank's remote pairs
    assert sum(r["sent"]["combine"] for r in res) == sum(r["remote_pairs"] for r in res) * H * 4
    measured = sum(r["sent"]["dispatch"] + r["sent"]["combine"] for r in res) / (2 * tokens)
    dispatch = sum(r["sent"]["dispatch"] for r in res) / (2 * tokens)
    planned = ep2.decode_comm_bytes_per_token
    print(f"EP2 bytes/token measured {measured:.0f} (dispatch {dispatch:.0f}) vs plan {planned:.0f}")


@pytest.mark.parametrize("fmt", ["plain", "fp8", "mxfp4", "int4"])
def test_experts_load_only_the_local_subset(monkeypatch, fmt):
    """Under EP (rank 1 of 2, 2 redundant slots; the state set by hand, no processes) a FusedMoE and its
    FP8 / MXFP4 / INT4 expert modules hold only this rank's slots: each filled from its logical
    expert's checkpoint tensors (replicas too), the other experts skipped, nothing reported missing."""
    from torch import nn

    from tokenfab.distributed import parallel_state as ps
    from tokenfab.kernels.quant import FP8
    from tokenfab.layers.moe import FusedMoE, load_moe_tensor
    from tokenfab.quant.fp8_experts import FP8Experts
    from tokenfab.quant.int4_ct import Int4Experts
    from tokenfab.quant.mxfp4 import Mxfp4Experts, deinterleave_rows

    st = ps.get_parallel_state()
    for name, value in (("ep_size", 2), ("ep_rank", 1), ("ep_redundant", 2)):
        monkeypatch.setattr(st, name, value)
    e, h, i = 8, 64, 32
    root = nn.Module()
    root.moe = FusedMoE(h, i, e, 2)
    moe = root.moe
    local = moe.placement.local_logical(1).tolist()
    assert moe.num_local_experts == 5 and len(local) == 5
    g = torch.Generator().manual_seed(0)
    if fmt == "plain":
        w13, w2 = torch.randn(e, 2 * i, h, generator=g), torch.randn(e, h, i, generator=g)
        done = []
        for x in range(e):
            done += load_moe_tensor(root, "moe", "gate", w13[x, :i], x) + load_moe_tensor(root, "moe", "up",
                                                                                           w13[x, i:], x)
        done += load_moe_tensor(root, "moe", "w2", w2)  # stacked: the local rows
        assert sorted(done) == ["moe.w13_weight", "moe.w2_weight"]
        assert torch.equal(moe.w13_weight, w13[local]) and torch.equal(moe.w2_weight, w2[local])
        return
    if fmt == "fp8":
        q = FP8Experts(moe, scheme="channel")
        moe.set_quant_experts(q)
        ws = {(x, kind): torch.randn(*((h, i) if kind == "down" else (i, h)), generator=g).to(FP8)
              for x in range(e) for kind in ("gate", "up", "down")}
        for (x, kind), w in ws.items():
            load_moe_tensor(root, "moe", kind, w, x, "weight")
            load_moe_tensor(root, "moe", kind, torch.full((w.shape[0], 1), x + 1.0), x, "weight_scale")
        for s, lg in enumerate(local):
            assert torch.equal(q.w13[s, :i].view(torch.uint8), ws[(lg, "gate")].view(torch.uint8))
            assert torch.equal(q.w2[s].view(torch.uint8), ws[(lg, "down")].view(torch.uint8))
            assert bool((q.w13_scale[s] == lg + 1.0).all())
    elif fmt == "mxfp4":
        q = Mxfp4Experts(moe)
        moe.set_quant_experts(q)
        blocks = torch.randint(0, 256, (e, 2 * i, h // 32, 16), generator=g, dtype=torch.uint8)
        scales = torch.randint(100, 140, (e, 2 * i, h // 32), generator=g, dtype=torch.uint8)
        load_moe_tensor(root, "moe", "w13", blocks, None, "blocks")
        load_moe_tensor(root, "moe", "w13", scales, None, "scales")
        load_moe_tensor(root, "moe", "w2", torch.zeros(e, h, i // 32, 16, dtype=torch.uint8), None, "blocks")
        load_moe_tensor(root, "moe", "w2", torch.zeros(e, h, i // 32, dtype=torch.uint8), None, "scales")
        assert torch.equal(q.w13_q, deinterleave_rows(blocks.reshape(e, 2 * i, -1))[local])
        assert torch.equal(q.w13_s, deinterleave_rows(scales)[local])
    else:
        q = Int4Experts(moe)
        moe.set_quant_experts(q)
        packed = {}
        for x in range(e):
            for kind in ("gate", "up", "down"):
                rows, k = (h, i) if kind == "down" else (i, h)
                packed[(x, kind)] = torch.randint(-2**31, 2**31 - 1, (rows, k // 8), generator=g, dtype=torch.int32)
                load_moe_tensor(root, "moe", kind, packed[(x, kind)], x, "weight_packed")
                load_moe_tensor(root, "moe", kind, torch.full((rows, k // 32), float(x)), x, "weight_scale")
        for s, lg in enumerate(local):
            assert torch.equal(q.w13_q[s, i:], packed[(lg, "up")].view(torch.uint8))
            assert bool((q.w2_s[s] == float(lg)).all())
    assert q.missing() == []


def _fp8_rank(rank: int) -> dict:
    from tokenfab.distributed import parallel_state as ps
    from tokenfab.kernels import moe_gemm
    from tokenfab.kernels.quant import FP8
    from tokenfab.layers.moe import FusedMoE, load_moe_tensor
    from tokenfab.quant import fp8_experts
    from tokenfab.quant.fp8_experts import FP8Experts

    torch.set_num_threads(1)
    ps.init_parallel(1)
    ps.init_expert_parallel(True, 2)
    ep_dispatch.set_ep_mode("auto", capacity=4)  # 12 tokens: normal; 3 tokens: low latency
    moe_gemm.F = fp8_experts.F = _RowwiseF()
    e, h, i, k = 8, 64, 32, 2
    root = torch.nn.Module()
    root.moe = FusedMoE(h, i, e, k)
    q = FP8Experts(root.moe, scheme="channel")
    root.moe.set_quant_experts(q)
    g = torch.Generator().manual_seed(0)
    root.moe.gate.weight.data.copy_(torch.randn(e, h, generator=g) * 0.3)
    w13, w2 = torch.zeros(e, 2 * i, h), torch.zeros(e, h, i)
    for x in range(e):
        for kind, rows, cols, dst in (("gate", i, h, w13[x, :i]), ("up", i, h, w13[x, i:]), ("down", h, i, w2[x])):
            w = (torch.randn(rows, cols, generator=g) * 4).to(FP8)
            s = torch.rand(rows, 1, generator=g) * 0.1 + 0.01
            load_moe_tensor(root, "moe", kind, w, x, "weight")
            load_moe_tensor(root, "moe", kind, s, x, "weight_scale")
            dst.copy_(w.float() * s)  # the dequantized twin
    res = {"missing": q.missing()}
    for n in (12, 3):
        x = torch.randn(n, h, generator=g)
        out = root.moe(x)
        weights, ids = root.moe.route(x)
        ref = moe_gemm.fused_experts_ref(x, w13, w2, weights, ids)
        res[n] = bool(torch.equal(out, ref))
    return res


@pytest.mark.slow
def test_fp8_experts_under_ep():
    """FP8 (per-channel) experts, EP 2 with 2 replica slots: each rank's layer equals the single-process
    product of the dequantized twin, bit for bit (row-invariant products), in both dispatch modes."""
    from tests.distributed.launch import run_ranks

    for r in run_ranks(_fp8_rank, 2):
        assert r == {"missing": [], 12: True, 3: True}


def _attention_dp_rank(rank: int, path: str) -> dict:
    """DeepSeek's serving layout on 2 ranks: attention data-parallel (each rank its own requests, its own
    latent cache) and the MoE layers expert-parallel over both. A rank with nothing to do runs an empty
    batch through the MoE layers, in lockstep with the busy one."""
    import torch.distributed as dist

    from tokenfab.distributed import parallel_state as ps
    from tokenfab.engine.llm_engine import LLMEngine
    from tokenfab.engine.requests.sampling_params import SamplingParams
    from tokenfab.layers.moe import FusedMoE

    torch.set_num_threads(1)
    ps.init_parallel(1)  # TP 1, DP 2
    ps.init_expert_parallel(True)
    ep_dispatch.set_ep_mode("normal")  # the ranks' batches differ: a mode that needs no agreement
    engine = LLMEngine(model=path, **ENGINE_ARGS)
    moes = [m for m in engine.runner.model.modules() if isinstance(m, FusedMoE)]
    forwards = []
    orig = engine.runner.execute

    def spy(batch):
        forwards.append(batch.num_tokens)
        return orig(batch)

    engine.runner.execute = spy
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    mine = PROMPTS[rank::2]
    for i, p in enumerate(mine):
        engine.add_request(f"r{i}", list(p), params)
    done, idle_steps = {}, 0
    while True:
        busy = torch.tensor([int(engine.has_unfinished_requests())])
        dist.all_reduce(busy)
        if int(busy) == 0:
            break
        if engine.has_unfinished_requests():
            n = len(forwards)
            for o in engine.step():
                if o.finished:
                    done[o.request_id] = list(o.outputs[0].token_ids)
            assert len(forwards) == n + 1, "a step without one forward would break the lockstep"
        else:
            idle_steps += 1
            hidden = moes[0].hidden_size
            with torch.inference_mode():
                for m in moes:
                    m(torch.empty(0, hidden))
    return {"tokens": [done[f"r{i}"] for i in range(len(mine))], "idle_steps": idle_steps,
            "max_tokens": max(forwards)}


@pytest.mark.slow
def test_attention_dp_plus_ep_deepseek(moe_models):
    """Attention-DP + EP on tiny DeepSeek-V3 (2 ranks): each rank serves its own requests and gets the
    tokens one process gives them; the shorter rank idles through the MoE collectives."""
    from tests.distributed.launch import run_ranks

    paths, refs = moe_models
    res = run_ranks(_attention_dp_rank, 2, paths["deepseek_v3"])
    ref = refs["deepseek_v3"][2:]  # the 4-prompt run of the fixture
    for rank, r in enumerate(res):
        assert r["tokens"] == ref[rank::2]
    assert sum(r["idle_steps"] for r in res) > 0  # the lockstep's empty batches were exercised


@pytest.mark.slow
def test_llm_launch_with_expert_parallel(moe_models):
    """The user path: ``LLM(tensor_parallel_size=2, enable_expert_parallel=True)`` (the engine spawns its
    worker) holds 4 of the 8 experts a rank and gives one process's greedy tokens."""
    from tokenfab import LLM, SamplingParams
    from tokenfab.layers.moe import FusedMoE

    paths, _ = moe_models
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)

    from tokenfab.distributed import parallel_state as ps

    def run(**kw):
        llm = LLM(model=paths["qwen3_moe"], **kw)
        try:
            moes = [m for m in llm.engine.runner.model.modules() if isinstance(m, FusedMoE)]
            return [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)], moes
        finally:
            llm.shutdown()  # the group left: this test process is single-process again

    one, _ = run()
    ep, moes = run(tensor_parallel_size=2, enable_expert_parallel=True)
    assert ep == one
    assert {(m.ep_size, m.num_local_experts) for m in moes} == {(2, 4)}
    assert ps.get_parallel_state().ep_size == 1
