"""EPLB placement (tokenfab/distributed/eplb.py) without processes: maps consistent, every logical expert
has a replica, redundant slots go to hot experts on other ranks, balance improves over the identity
placement, and replica selection spreads a hot expert's tokens."""

from __future__ import annotations

import pytest
import torch

from tokenfab.distributed.eplb import (
    balance,
    identity_placement,
    maps_from_phy2log,
    rank_loads,
    rebalance_experts,
    select_replica,
)


def _check_maps(pl, num_logical: int, ep: int, num_redundant: int) -> None:
    assert pl.num_physical == num_logical + num_redundant and pl.num_local * ep == pl.num_physical
    assert int(pl.logcnt.min()) >= 1 and int(pl.logcnt.sum()) == pl.num_physical
    assert torch.equal(torch.bincount(pl.phy2log, minlength=num_logical), pl.logcnt)
    seen = set()
    for lg in range(num_logical):
        reps = pl.log2phy[lg, : int(pl.logcnt[lg])].tolist()
        assert all(pl.phy2log[p] == lg for p in reps)  # log2phy and phy2log agree
        assert (pl.log2phy[lg, int(pl.logcnt[lg]):] == -1).all()
        seen.update(reps)
    assert seen == set(range(pl.num_physical))  # every physical slot listed exactly once


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("experts,ep,redundant", [(8, 2, 0), (8, 2, 2), (16, 4, 4), (64, 8, 8), (12, 4, 0)])
def test_rebalance_maps_and_balance(seed, experts, ep, redundant):
    g = torch.Generator().manual_seed(seed)
    load = torch.rand(experts, generator=g) ** 4 * 1000  # skewed: a few hot experts
    load[int(torch.randint(experts, (1,), generator=g))] *= 20
    pl = rebalance_experts(load, ep, redundant)
    _check_maps(pl, experts, ep, redundant)
    base = identity_placement(experts, ep, redundant)
    _check_maps(base, experts, ep, redundant)
    # against no EPLB (expert e on rank e // (E / ep), no replicas)
    assert balance(load, pl) <= balance(load, identity_placement(experts, ep)) + 1e-12
    # greedy packing bound: the heaviest rank exceeds the mean by at most one replica's share
    share = (load.double() / pl.logcnt.double())[pl.phy2log]
    loads = rank_loads(load, pl)
    assert float(loads.max()) <= float(loads.mean()) + float(share.max()) + 1e-9
    assert abs(float(loads.sum()) - float(load.double().sum())) < 1e-6 * float(load.sum())


def test_hot_expert_replicated_on_other_ranks():
    load = torch.tensor([1000.0, 10, 10, 10, 10, 10, 10, 10])
    pl = rebalance_experts(load, 4, 4)
    assert pl.logcnt.tolist() == [4, 2, 1, 1, 1, 1, 1, 1]  # one replica per rank at most, then the next
    ranks = {int(p) // pl.num_local for p in pl.log2phy[0]}
    assert ranks == {0, 1, 2, 3}  # the hot expert's replicas sit on every rank
    assert balance(load, pl) < balance(load, identity_placement(8, 4)) / 2
    assert balance(load, pl) < 1.1


def test_identity_placement():
    pl = identity_placement(8, 4)
    assert pl.phy2log.tolist() == list(range(8)) and pl.logcnt.tolist() == [1] * 8
    assert pl.local_logical(2).tolist() == [4, 5]
    pl = identity_placement(6, 4, 2)  # 8 slots: experts 0 and 1 get a second replica
    assert pl.logcnt.tolist() == [2, 2, 1, 1, 1, 1]


def test_bad_inputs_are_clear_errors():
    with pytest.raises(ValueError, match="divide"):
        rebalance_experts(torch.ones(7), 2, 0)
    with pytest.raises(ValueError, match="non-negative"):
        rebalance_experts(torch.tensor([1.0, -1.0]), 2, 0)
    with pytest.raises(ValueError, match="no physical replica"):
        maps_from_phy2log(torch.tensor([0, 0, 1, 1]), 3, 2)


def test_select_replica_spreads_tokens():
    pl = rebalance_experts(torch.tensor([100.0, 1, 1, 1, 1, 1]), 4, 2)  # expert 0: 3 replicas
    ids = torch.tensor([[0, 1]] * 9, dtype=torch.int32)
    phys = select_replica(ids, pl.log2phy, pl.logcnt)
    assert torch.equal(pl.phy2log[phys], ids.long())  # every pick lands on a replica of its expert
    counts = torch.bincount(phys[:, 0], minlength=pl.num_physical)
    assert sorted(counts[pl.log2phy[0]].tolist()) == [3, 3, 3]  # the hot expert's tokens spread evenly
