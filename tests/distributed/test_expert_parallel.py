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
from tokenfab.distributed.plan import expected_remote_ranks

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


@pytest.mark.parametrize("mode", ["normal", "low_latency"])
@pytest.mark.parametrize("ep,experts,redundant,k", [(2, 8, 0, 2), (4, 8, 4, 3)])
def test_dispatch_combine_bit_identical(mode, ep, experts, redundant, k):
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
