"""The mixture-of-experts layer: router, stacked expert weights, optional shared experts.

    weights, ids = route(x Wr^T (+ br))                     softmax top-k, or grouped (DeepSeek)
    out = sum_j weights_j * E_{ids_j}(x)  (+ shared(x), gated by sigmoid(x Wg^T) if asked)

The experts' weights are stacked so one kernel launch serves all of them:
``w13_weight`` [E, 2I, H] (each expert's gate rows, then its up rows), ``w2_weight`` [E, H, I],
optional biases ``w13_bias`` [E, 2I] and ``w2_bias`` [E, H]. Loading them from checkpoints is
``moe_loading``'s (``load_moe_tensor`` and ``load_expert_checkpoint_tensor`` are importable here too).
"""

from __future__ import annotations

import torch
from torch import nn

from tokenfab.distributed import ep_dispatch, two_batch
from tokenfab.distributed import parallel_state as ps
from tokenfab.distributed.admission import check_moe_layout, experts_tp_sharded
from tokenfab.distributed.eplb import ExpertPlacement, identity_placement, rebalance_experts, select_replica
from tokenfab.kernels import silu_and_mul
from tokenfab.kernels.moe import ACTIVATIONS, fused_experts, grouped_topk, topk_softmax
from tokenfab.layers.linear import Linear, MergedLinear
from tokenfab.layers.moe_loading import ExpertLoading, load_expert_checkpoint_tensor, load_moe_tensor

__all__ = ["FusedMoE", "GatedMLP", "load_expert_checkpoint_tensor", "load_moe_tensor"]


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): a dense SwiGLU MLP (shared experts, dense layers)."""

    def __init__(self, hidden_size: int, intermediate_size: int, bias: bool = False) -> None:
        super().__init__()
        # tensor parallel at TP > 1: gate/up column-, down row-parallel (its all-reduce gives every rank the sum)
        self.gate_up_proj = MergedLinear(hidden_size, [intermediate_size, intermediate_size], bias=bias,
                                         parallel="column")
        self.down_proj = Linear(intermediate_size, hidden_size, bias=bias, parallel="row")

    @property
    def ends_in_all_reduce(self) -> bool:  # two-batch overlap: down_proj's all-reduce is the last op
        return getattr(self.down_proj, "reduce_output", False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class FusedMoE(ExpertLoading, nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        *,
        renormalize: bool = True,
        scoring: str = "softmax",
        num_expert_groups: int = 1,
        topk_groups: int = 1,
        routed_scaling_factor: float = 1.0,
        correction_bias: bool = False,
        router_bias: bool = False,
        expert_bias: bool = False,
        activation: str = "silu",
        swiglu_alpha: float = 1.702,
        swiglu_limit: float = 7.0,
        shared_experts: nn.Module | None = None,
        shared_expert_gate: bool = False,
    ) -> None:
        """``scoring`` "softmax" with one group and no correction bias routes by softmax top-k
        (``renormalize``: the k weights sum to 1); anything else by ``grouped_topk``.
        ``activation``: "silu" (silu(g) * u) or "swiglu_oai" (GPT-OSS, with alpha and limit).

        Parallel layout (read from ``parallel_state`` when the layer is built):
        - expert parallel (EP size > 1): this rank holds ``num_local_experts`` = (E + redundant) / ep
          whole physical experts (``placement``: EPLB's phy2log/log2phy/logcnt), tokens go to them
          by all-to-all (``distributed/ep_dispatch.py``); under TP the TP ranks split the (identical)
          tokens, dispatch their share and all-gather the results;
        - TP without EP: every expert's intermediate dim is split (w13 by rows, w2 by columns; the
          down bias is added on TP rank 0 only) and the partial outputs are all-reduced.
        """
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, not {activation!r}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in 1..{num_experts}, got {top_k}")
        st = ps.get_parallel_state()
        self.ep_size, self.ep_rank = st.ep_size, st.ep_rank
        self.tp_size, self.tp_rank = st.tp_size, st.tp_rank
        self.tp_sharded = experts_tp_sharded(self.tp_size, self.ep_size)
        check_moe_layout(self.tp_size, self.ep_size, intermediate_size=intermediate_size)
        self.full_intermediate_size = intermediate_size
        if self.tp_sharded:
            intermediate_size //= self.tp_size
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.num_experts, self.top_k = num_experts, top_k
        self.renormalize, self.scoring = renormalize, scoring
        self.num_expert_groups, self.topk_groups = num_expert_groups, topk_groups
        self.routed_scaling_factor = float(routed_scaling_factor)
        self.activation, self.swiglu_alpha, self.swiglu_limit = activation, float(swiglu_alpha), float(swiglu_limit)
        self.gate = Linear(hidden_size, num_experts, bias=router_bias)
        self.placement: ExpertPlacement | None = None
        self.num_local_experts = num_experts
        if self.ep_size > 1:
            self._set_placement(identity_placement(num_experts, self.ep_size, st.ep_redundant))
        # tokens routed to each logical expert since the last rebalance (this rank's; on the device)
        self.register_buffer("expert_load", torch.zeros(num_experts, dtype=torch.int64), persistent=False)
        e, i, h = self.num_local_experts, intermediate_size, hidden_size
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.w13_bias = nn.Parameter(torch.empty(e, 2 * i), requires_grad=False) if expert_bias else None
        self.w2_bias = nn.Parameter(torch.empty(e, h), requires_grad=False) if expert_bias else None
        self.e_score_correction_bias = (
            nn.Parameter(torch.empty(num_experts, dtype=torch.float32), requires_grad=False)
            if correction_bias else None
        )
        self.shared_experts = shared_experts
        self.shared_expert_gate = Linear(hidden_size, 1) if shared_expert_gate else None
        self._loaded: dict[str, set] = {}
        # quantized experts (tokenfab/quant): when set, they replace the stacked weights' product and
        # take the checkpoint's expert tensors (load_expert(kind, suffix, tensor, local slot)); they
        # are built for ``num_local_experts`` experts
        self.quant_experts: nn.Module | None = None

    def _set_placement(self, placement: ExpertPlacement) -> None:
        self.placement = placement
        self.num_local_experts = placement.num_local
        self._local_logical = placement.local_logical(self.ep_rank).tolist()
        dev = self.gate.weight.device if hasattr(self, "gate") else None
        if dev is not None and dev.type == "meta":  # a quantized build (weights on meta): maps are real
            dev = torch.get_default_device()
        for name in ("log2phy", "logcnt"):
            t = getattr(placement, name).to(dev)
            if name in self._buffers:
                self._buffers[name] = t
            else:
                self.register_buffer(name, t, persistent=False)

    def set_quant_experts(self, experts: nn.Module) -> None:
        """Hand the experts' product and weights to a quantized module; the plain stacked weights go."""
        check_moe_layout(self.tp_size, self.ep_size, quantized_experts=True)  # TP-split quantized experts: refused
        self.quant_experts = experts
        for name in ("w13_weight", "w2_weight", "w13_bias", "w2_bias"):
            setattr(self, name, None)

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (weights [T, k] fp32, expert ids [T, k] int32)."""
        logits = self.gate(x)
        if self.scoring == "softmax" and self.num_expert_groups == 1 and self.e_score_correction_bias is None:
            w, ids = topk_softmax(logits, self.top_k, self.renormalize)
            if self.routed_scaling_factor != 1.0:
                w = w * self.routed_scaling_factor
            return w, ids
        return grouped_topk(
            logits, self.e_score_correction_bias, self.top_k, self.num_expert_groups, self.topk_groups,
            self.renormalize, self.routed_scaling_factor, self.scoring,
        )

    def experts(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """This rank's stacked experts (ids are local slots) on x [T, H] -> [T, H]."""
        if self.quant_experts is not None:
            return self.quant_experts(x, weights, ids)
        return fused_experts(
            x, self.w13_weight, self.w2_weight, weights, ids, self.w13_bias, self.w2_bias, self.activation,
            self.swiglu_alpha, self.swiglu_limit,
        )

    def _count_load(self, ids: torch.Tensor) -> None:
        flat = ids.reshape(-1).long()
        self.expert_load.index_add_(0, flat, torch.ones_like(flat))  # no host sync

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.ep_size > 1:  # the all-to-alls' stages drained at once (host syncs anyway: not compiled)
            out = two_batch.run_plain(self._forward_ep(x))
        else:
            out = self._local_experts(x)
            if self.tp_sharded:
                joins = self._shared_joins_partial_sum()
                out = ps.tp_all_reduce(self._add_shared(x, out) if joins else out)
                return out if joins else self._add_shared(x, out)
        return self._add_shared(x, out)

    def _local_experts(self, x: torch.Tensor) -> torch.Tensor:
        """Route x, count the load, run this rank's experts (no EP: every expert, or its TP slice)."""
        weights, ids = self.route(x)
        self._count_load(ids)
        return self.experts(x, weights, ids)

    _shared_partial: bool | None = None

    def _shared_in_partial_sum(self) -> bool:
        """TP-split experts: may the shared experts join the routed experts' partial sum, so that one
        all-reduce covers both? Yes when their down projection is row-parallel (it all-reduces its own
        output): decided once, and that projection then leaves its partial sum (the gate is replicated,
        so gate * partial sums to gate * full)."""
        if self._shared_partial is None:
            down = getattr(self.shared_experts, "down_proj", None)
            self._shared_partial = bool(getattr(down, "reduce_output", False))
            if self._shared_partial:
                down.reduce_output = False
        return self._shared_partial

    def _shared_joins_partial_sum(self) -> bool:
        """TP-split experts: the shared experts are added before the all-reduce (one collective for
        both), not after it."""
        return self.shared_experts is not None and self._shared_in_partial_sum()

    def _add_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out`` + the (gated) shared experts."""
        if self.shared_experts is None:
            return out
        shared = self.shared_experts(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate(x)) * shared
        return out + shared

    def forward_stages(self, x: torch.Tensor) -> two_batch.Stages:
        """``forward`` with a yield point after each collective (two-batch overlap: EP all-to-alls, the
        TP-split experts' all-reduce). ``forward`` stays generator-free for torch.compile."""
        if self.ep_size > 1:
            out = yield from self._forward_ep(x)
        else:
            out = self._local_experts(x)
            if self.tp_sharded:
                joins = self._shared_joins_partial_sum()
                out = yield from two_batch.collective(ps.tp_all_reduce, self._add_shared(x, out) if joins else out)
                return out if joins else self._add_shared(x, out)
        return self._add_shared(x, out)

    def _forward_ep(self, x: torch.Tensor) -> two_batch.Stages:
        t = x.shape[0]
        chunk = -(-t // self.tp_size)
        xs = x[self.tp_rank * chunk:(self.tp_rank + 1) * chunk] if self.tp_size > 1 else x
        weights, ids = self.route(xs)
        self._count_load(ids)
        phys = select_replica(ids, self.log2phy, self.logcnt)
        mode, capacity = ep_dispatch.ep_mode()
        if mode == "auto":  # decode-sized batches go the static low-latency way; decided on the
            mode = "low_latency" if chunk <= capacity else "normal"  # TP group's common chunk size
        out = yield from ep_dispatch.dispatch_combine_stages(xs, phys, weights, self.experts, self.ep_size,
                                                             self.num_local_experts, mode, capacity)
        if self.tp_size > 1:
            if out.shape[0] < chunk:
                out = torch.cat((out, out.new_zeros(chunk - out.shape[0], out.shape[1])))
            out = ps.tp_all_gather_rows(out)[:t]
        return out

    # ------------------------------------------------------------------ EPLB

    def _expert_tensors(self) -> list[torch.Tensor]:
        """Every tensor stacked by local expert slot (plain or quantized), for rebalancing."""
        if self.quant_experts is not None:
            return [b for b in self.quant_experts.buffers() if b is not None and b.dim() > 0
                    and b.shape[0] == self.num_local_experts]
        return [p.data for p in (self.w13_weight, self.w2_weight, self.w13_bias, self.w2_bias) if p is not None]

    @torch.no_grad()
    def rebalance(self, load: torch.Tensor | None = None) -> ExpertPlacement:
        """Re-place the experts from ``load`` [E] (default: the measured ``expert_load`` summed over the
        EP group) with the same number of redundant slots; every EP rank calls it between steps.
        Weights move by one all-gather of each stacked expert tensor over the EP group (transiently
        every physical expert on each rank: simple, sized for modest layers), then each new slot copies
        a replica of its logical expert. The load counter restarts."""
        if self.placement is None:
            raise RuntimeError("rebalance needs expert parallelism (EP size > 1)")
        if load is None:
            load = ps.ep_all_reduce(self.expert_load.clone())
        old = self.placement
        new = rebalance_experts(load, self.ep_size, old.num_physical - old.num_logical)
        src = old.log2phy[new.local_logical(self.ep_rank), 0]  # a replica of each new slot's expert
        for t in self._expert_tensors():
            full = ps.ep_all_gather(t)
            t.copy_(full[src.to(full.device)])
        self._set_placement(new)
        self.expert_load.zero_()
        return new
