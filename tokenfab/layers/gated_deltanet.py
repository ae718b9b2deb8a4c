"""Gated DeltaNet: the linear-attention token mixer of Qwen3-Next and Qwen3.5 (3 of every 4 layers).

Per token, with H the hidden state (arXiv 2412.06464; transformers' ``Qwen3NextGatedDeltaNet``):

    [q | k | v] = SiLU(causal_conv1d([x Wq | x Wk | x Wv]))     short depthwise conv (width 4) over time
    z = x Wz;  b = x Wb;  a = x Wa                               per value head: b, a scalars
    g = -exp(A_log) * softplus(a + dt_bias);  beta = sigmoid(b)   log decay (<= 0), write strength
    S = exp(g) S;  S = S + beta k (v - k^T S)^T;  o = q^T S      the gated delta rule (q, k L2-normalised,
                                                                 q scaled by Dk^-0.5), per value head
    out = (RMSNorm(o) * w * SiLU(z)) Wo                           norm per head over Dv, gated by z

Key heads are grouped: value head h reads query/key head h // (Hv / Hk).

State (``recurrent_state_spec``), one slot per running sequence, bound by the model runner as
``conv_state`` [slots, conv_dim, W - 1] (the last W - 1 conv inputs, the model dtype) and ``ssm_state``
[slots, Hv, Dk, Dv] (float32); ``batch.state_slots`` [B] names each sequence's slot. A sequence whose
first new token sits at position 0 starts from zeros, any other continues its slot (chunked prefill,
decode); both states are updated in place.

Paths: a step whose every sequence has one new token (``max_query_len == 1``) runs the one-step conv
update and recurrent decode kernels, with no host sync (CUDA graphs capture it); any other step the varlen
conv and chunked prefill kernels (decode rows in it are length-1 sequences), which take "starts fresh" per
sequence. The decode kernels have no such flag, and a fresh sequence can reach them (a one-token prompt):
its conv state slot is zeroed first (``zero_fresh_rows_``), and its ``g`` is -inf, so the recurrent
state's old contents are multiplied by exp(-inf) = 0 and the step starts from zeros.

Checkpoint layouts: Qwen3.5 stores ``in_proj_qkv``, ``in_proj_z``, ``in_proj_b``, ``in_proj_a`` (loaded
into the merged ``in_proj_qkvz`` and ``in_proj_ba`` by the model's ``packed_modules``); Qwen3-Next stores
``in_proj_qkvz`` and ``in_proj_ba`` with the rows interleaved per key-head group, which
``qwen3_next_projection_rows`` puts into the same [q | k | v | z] and [b | a] order.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenfab.distributed import parallel_state as ps
from tokenfab.forward_batch import ForwardBatch
from tokenfab.kernels import (
    causal_conv1d_prefill,
    causal_conv1d_update,
    gated_delta_decode,
    gated_delta_prefill,
    rms_norm,
)
from tokenfab.kernels.gated_delta_ref import gdn_gating_ref
from tokenfab.layers.linear import Linear, MergedLinear
from tokenfab.layers.tp_split import TPSplitError

#: checkpoint projection name -> (our merged module, shard index): Qwen3.5's separate projections
GDN_PACKED_MODULES = {
    "in_proj_qkv": ("in_proj_qkvz", 0),
    "in_proj_z": ("in_proj_qkvz", 1),
    "in_proj_b": ("in_proj_ba", 0),
    "in_proj_a": ("in_proj_ba", 1),
}


class GatedDeltaNet(nn.Module):
    """One linear-attention layer (module docstring). Tensor and expert parallelism are not
    supported (the projections and states are not split): building one at TP or EP > 1 is an error."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        st = ps.get_parallel_state()
        if st.tp_size > 1 or st.ep_size > 1:
            raise TPSplitError("Gated DeltaNet layers (Qwen3-Next / Qwen3.5) are not tensor- or expert-parallel yet")
        hidden = config.hidden_size
        self.num_k_heads, self.num_v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        self.head_k_dim, self.head_v_dim = config.linear_key_head_dim, config.linear_value_head_dim
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"linear_num_value_heads ({self.num_v_heads}) must be a multiple of "
                             f"linear_num_key_heads ({self.num_k_heads})")
        self.key_dim = self.num_k_heads * self.head_k_dim
        self.value_dim = self.num_v_heads * self.head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel_size = config.linear_conv_kernel_dim
        act = getattr(config, "hidden_act", "silu")
        if act not in ("silu", "swish"):
            raise ValueError(f"Gated DeltaNet: only the SiLU conv activation is supported, not {act!r}")
        self.in_proj_qkvz = MergedLinear(hidden, [self.conv_dim, self.value_dim])
        self.in_proj_ba = MergedLinear(hidden, [self.num_v_heads, self.num_v_heads])
        # the checkpoint's nn.Conv1d weight [conv_dim, 1, W] (depthwise, no bias)
        self.conv1d = nn.Module()
        self.conv1d.weight = nn.Parameter(torch.empty(self.conv_dim, 1, self.conv_kernel_size), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.num_v_heads), requires_grad=False)
        self.norm = nn.Module()  # the gated RMSNorm over each head's Dv (a plain weight, not 1 + w)
        self.norm.weight = nn.Parameter(torch.empty(self.head_v_dim), requires_grad=False)
        self.norm_eps = config.rms_norm_eps
        self.out_proj = Linear(self.value_dim, hidden)
        self.scale = self.head_k_dim**-0.5
        self.state_dtype = self.conv1d.weight.dtype
        # bound by the model runner: [num_state_slots, *shape] (recurrent_state_spec)
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None
        # speculative decoding: called with (self, x, batch) first in each forward to keep the verify rows'
        # inputs, which a rejected draft's rollback replays (speculative/state_rollback.py); None: off
        self.input_tap: Callable[[nn.Module, torch.Tensor, ForwardBatch], None] | None = None

    def recurrent_state_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-sequence state tensors: name -> (shape of one slot, dtype)."""
        return {
            "conv_state": ((self.conv_dim, self.conv_kernel_size - 1), self.state_dtype),
            "ssm_state": ((self.num_v_heads, self.head_k_dim, self.head_v_dim), torch.float32),
        }

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]; reads and writes the slots of ``batch.state_slots``."""
        assert self.ssm_state is not None and self.conv_state is not None, "recurrent state not bound"
        if self.input_tap is not None:
            self.input_tap(self, x, batch)
        t = x.shape[0]
        slots = batch.state_slots
        cu = batch.cu_seqlens_q
        # a sequence continues its slot unless its first new token is at position 0
        has_state = batch.positions.index_select(0, cu[:-1].long()) != 0
        mixed, z = self.in_proj_qkvz.forward(x).split([self.conv_dim, self.value_dim], dim=-1)
        b, a = self.in_proj_ba.forward(x).split([self.num_v_heads, self.num_v_heads], dim=-1)
        weight = self.conv1d.weight.view(self.conv_dim, -1)
        decode = batch.max_query_len == 1
        if decode:  # no host sync on this path (CUDA graphs): fresh rows' conv states zeroed first
            zero_fresh_rows_(self.conv_state, slots, ~has_state)
            mixed = causal_conv1d_update(mixed, weight, None, self.conv_state, slots, True)
        else:
            mixed = causal_conv1d_prefill(mixed, weight, None, cu, self.conv_state, slots, has_state, True)
        q, k, v = mixed.split([self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.view(t, self.num_k_heads, self.head_k_dim)
        k = k.view(t, self.num_k_heads, self.head_k_dim)
        v = v.view(t, self.num_v_heads, self.head_v_dim)
        g, beta = gdn_gating_ref(a, b, self.A_log, self.dt_bias)
        if decode:
            g = torch.where(has_state[:, None], g, float("-inf"))  # a fresh one-token sequence: S = 0 first
            o = gated_delta_decode(q, k, v, g, beta, self.ssm_state, slots, self.scale, True)
        else:
            o = gated_delta_prefill(q, k, v, g, beta, cu, self.ssm_state, slots, has_state, self.scale, True)
        o = rms_norm(o.reshape(-1, self.head_v_dim), self.norm.weight, self.norm_eps)
        o = (o.view(t, -1) * F.silu(z.float())).to(x.dtype)
        return self.out_proj.forward(o)


def zero_fresh_rows_(state: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor) -> None:
    """Zero the state slots of the rows with ``fresh`` set, without a host sync: every row's slot is read
    and written back (zeros where fresh). Padding rows (slot -1) stand in for the first real row (same
    slot, same value), so no two rows write different values to one slot."""
    real = slots >= 0
    first = real.to(torch.int32).argmax()
    rows = torch.where(real, torch.arange(slots.shape[0], device=slots.device), first)
    idx = slots.index_select(0, rows).long()
    reset = fresh.index_select(0, rows) & (idx >= 0)
    idx = idx.clamp(min=0)
    kept = state.index_select(0, idx) * (~reset).to(state.dtype).view(-1, *[1] * (state.dim() - 1))
    state.index_copy_(0, idx, kept)


def qwen3_next_projection_rows(name: str, tensor: torch.Tensor, layer: GatedDeltaNet) -> torch.Tensor:
    """Qwen3-Next's ``in_proj_qkvz`` / ``in_proj_ba`` rows (grouped per key head: [q_g, k_g, v_g, z_g] and
    [b_g, a_g] for each group g) in our order ([q | k | v | z] and [b | a], heads in order)."""
    nk, dk, dv = layer.num_k_heads, layer.head_k_dim, layer.head_v_dim
    r = layer.num_v_heads // nk
    hidden = tensor.shape[-1]
    if name.endswith("in_proj_qkvz.weight"):
        sizes = [dk, dk, r * dv, r * dv]
    elif name.endswith("in_proj_ba.weight"):
        sizes = [r, r]
    else:
        raise ValueError(f"not a Qwen3-Next Gated DeltaNet projection: {name}")
    if tensor.shape != (nk * sum(sizes), hidden):
        raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {(nk * sum(sizes), hidden)}")
    parts = tensor.view(nk, sum(sizes), hidden).split(sizes, dim=1)
    return torch.cat([p.reshape(-1, hidden) for p in parts], dim=0)
