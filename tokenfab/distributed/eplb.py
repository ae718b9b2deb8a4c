"""Expert-parallel load balancing (EPLB): redundant experts and the logical <-> physical maps.

Under expert parallelism the ``ep`` ranks hold ``P = E + R`` *physical* experts, ``L = P / ep`` each
(rank r holds physical ids ``[r*L, (r+1)*L)``). Every one of the E *logical* experts (the router's
ids) has at least one physical replica; the R redundant slots go to the hottest ones. Three maps
describe a placement (DeepSeek EPLB's names):

    phy2log [P]          the logical expert a physical slot holds
    log2phy [E, maxrep]  the physical replicas of each logical expert (-1 padded)
    logcnt  [E]          how many replicas each logical expert has

``rebalance_experts(load, ep, num_redundant)`` builds them from a measured per-expert load (tokens
routed to each logical expert, e.g. FusedMoE's ``expert_load`` counter):
1. replicas: each of the R redundant slots goes, one at a time, to the logical expert whose load per
   replica is largest (a replica takes an equal share of its expert's tokens), at most ep replicas;
2. packing: the P replicas, heaviest first, each go to the least-loaded rank that still has a free
   slot and, where possible, no replica of the same expert yet (a second copy on the same rank
   spreads nothing). Ranks end with exactly L slots each.
This is the greedy longest-processing-time rule: the heaviest rank is within one replica's load of
the mean. ``balance(load, phy2log, ep)`` (max rank load / mean rank load, 1.0 = perfect) measures it.

``select_replica`` spreads a replicated expert's tokens over its replicas (by token index), without
a host sync; it is what FusedMoE calls on each step's routed ids.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class ExpertPlacement:
    phy2log: torch.Tensor  # [P] int64
    log2phy: torch.Tensor  # [E, maxrep] int64, -1 padded
    logcnt: torch.Tensor  # [E] int64
    ep_size: int

    @property
    def num_physical(self) -> int:
        return self.phy2log.numel()

    @property
    def num_logical(self) -> int:
        return self.logcnt.numel()

    @property
    def num_local(self) -> int:
        return self.num_physical // self.ep_size

    def local_logical(self, rank: int) -> torch.Tensor:
        """The logical expert of each of ``rank``'s local slots, [L]."""
        n = self.num_local
        return self.phy2log[rank * n:(rank + 1) * n]


def maps_from_phy2log(phy2log: torch.Tensor, num_logical: int, ep_size: int) -> ExpertPlacement:
    """log2phy and logcnt from a phy2log map (checked: every logical expert has a replica)."""
    phy2log = phy2log.to(torch.int64).cpu()
    if phy2log.numel() % ep_size:
        raise ValueError(f"{phy2log.numel()} physical experts do not divide over {ep_size} ranks")
    if phy2log.numel() and (int(phy2log.min()) < 0 or int(phy2log.max()) >= num_logical):
        raise ValueError("phy2log holds ids outside the logical experts")
    logcnt = torch.bincount(phy2log, minlength=num_logical)
    if int(logcnt.min()) < 1:
        missing = torch.nonzero(logcnt == 0).flatten().tolist()
        raise ValueError(f"logical experts {missing} have no physical replica")
    log2phy = torch.full((num_logical, int(logcnt.max())), -1, dtype=torch.int64)
    order = torch.argsort(phy2log, stable=True)  # physical ids grouped by logical, ascending
    starts = torch.cumsum(logcnt, 0) - logcnt
    col = torch.arange(phy2log.numel()) - starts[phy2log[order]]
    log2phy[phy2log[order], col] = order
    return ExpertPlacement(phy2log, log2phy, logcnt, ep_size)


def identity_placement(num_experts: int, ep_size: int, num_redundant: int = 0) -> ExpertPlacement:
    """No load known: expert e on slot e; the R redundant slots replicate experts 0..R-1 (placed by
    the packing rule, so replicas land on other ranks than their originals)."""
    if num_redundant == 0:
        if num_experts % ep_size:
            raise ValueError(f"{num_experts} experts do not divide over {ep_size} expert-parallel ranks")
        return maps_from_phy2log(torch.arange(num_experts), num_experts, ep_size)
    load = torch.zeros(num_experts, dtype=torch.float64)
    load[:num_redundant] = 1.0  # ties broken towards the lower ids: replicate 0..R-1
    return rebalance_experts(load + 1.0, ep_size, num_redundant)


def rebalance_experts(load: torch.Tensor, ep_size: int, num_redundant: int = 0) -> ExpertPlacement:
    """A placement of ``E + num_redundant`` physical experts over ``ep_size`` ranks from a per-logical-
    expert load [E] (any non-negative numbers). Deterministic: ties go to the lower id / rank."""
    load = load.detach().to(torch.float64).cpu().flatten()
    e = load.numel()
    p = e + num_redundant
    if ep_size < 1 or p % ep_size:
        raise ValueError(f"{e} experts + {num_redundant} redundant do not divide over {ep_size} ranks")
    if num_redundant < 0 or bool((load < 0).any()):
        raise ValueError("the load and the number of redundant experts must be non-negative")
    per_rank = p // ep_size
    cnt = torch.ones(e, dtype=torch.int64)
    for _ in range(num_redundant):  # R small (tens): a loop over slots, not tokens
        per = load / cnt
        per[cnt >= ep_size] = -1.0  # a replica per rank at most: a second one on a rank spreads nothing
        cnt[int(torch.argmax(per))] += 1
    share = load / cnt
    replicas = torch.repeat_interleave(torch.arange(e), cnt)  # logical id of each replica
    order = sorted(range(p), key=lambda j: (-float(share[replicas[j]]), int(replicas[j])))
    rank_load = [0.0] * ep_size
    slots: list[list[int]] = [[] for _ in range(ep_size)]
    for j in order:
        lg = int(replicas[j])
        free = [r for r in range(ep_size) if len(slots[r]) < per_rank]
        fresh = [r for r in free if lg not in slots[r]] or free
        r = min(fresh, key=lambda q: (rank_load[q], q))
        slots[r].append(lg)
        rank_load[r] += float(share[lg])
    phy2log = torch.tensor([lg for r in range(ep_size) for lg in sorted(slots[r])], dtype=torch.int64)
    return maps_from_phy2log(phy2log, e, ep_size)


def rank_loads(load: torch.Tensor, placement: ExpertPlacement) -> torch.Tensor:
    """Expected load of each rank [ep] when a logical expert's load splits evenly over its replicas."""
    share = load.to(torch.float64).cpu() / placement.logcnt.to(torch.float64)
    return share[placement.phy2log].view(placement.ep_size, -1).sum(dim=1)


def balance(load: torch.Tensor, placement: ExpertPlacement) -> float:
    """max rank load / mean rank load (1.0 = perfectly balanced)."""
    r = rank_loads(load, placement)
    mean = float(r.mean())
    return float(r.max()) / mean if mean > 0 else 1.0


def select_replica(ids: torch.Tensor, log2phy: torch.Tensor, logcnt: torch.Tensor) -> torch.Tensor:
    """Logical ids [T, k] -> physical ids [T, k]: a token's pick of a replicated expert goes to
    replica ``(t + j) mod count`` (t the token row, j the slot), so consecutive tokens alternate
    between replicas. Tensor ops only (no sync); identical on every rank for the same batch."""
    t, k = ids.shape
    il = ids.long()
    spread = (torch.arange(t, device=ids.device)[:, None] + torch.arange(k, device=ids.device)[None, :])
    col = spread % logcnt[il]
    return log2phy[il, col]
