"""Which parallel layouts the engine serves: the admission rules as plain functions.

The engine calls them where it refuses a layout (``layers/moe.py`` when a MoE layer is built or given
quantized experts, ``executors/dp_lockstep.py`` before an attention-DP + EP launch, ``server/cli.py``
when torchrun starts ``tokenfab serve``), and
``tokenfab plan`` calls the same functions so that it never proposes a layout the engine refuses.
They take plain numbers and flags (no torch, no process groups) and raise with the engine's message.

Why each rule exists (``docs/parallelism-layouts.md`` has the user-facing version):

- Quantized routed experts are kept packed per expert (4-bit nibbles, FP8 with per-block or
  per-row scales); the expert kernels take whole experts, so splitting each expert's intermediate
  dimension over TP ranks is not implemented: such a model needs ``--enable-expert-parallel``
  (whole experts per rank) when TP > 1.
- Attention-DP + EP steps its replicas in lockstep (one forward per engine step on every rank, so
  the MoE all-to-alls meet): TP 1 per replica, and nothing that changes the number of MoE calls per
  step on one rank only (speculative decoding, async scheduling, EPLB, two-batch overlap).
- Expert parallelism places ``experts + redundant`` physical experts evenly on the EP ranks.
- Data-parallel replicas start on the local node: ``engine/core/dp_client.py`` spawns every replica
  (and its TP workers) on this machine, and attention-DP + EP meets on a loopback rendezvous. The one
  multi-node launch, torchrun, runs a single TP group (every rank a TP rank) and takes no
  ``--data-parallel-size``. So a DP deployment's DP x TP GPUs sit on one node; TP alone may span nodes.
"""

from __future__ import annotations

TORCHRUN_DP_MESSAGE = "under torchrun every rank is one TP group: drop --data-parallel-size"
QUANTIZED_EXPERTS_TP_MESSAGE = ("quantized experts split by tensor parallelism are not supported: "
                                "use --enable-expert-parallel (whole experts per rank)")


def experts_tp_sharded(tp_size: int, ep_size: int) -> bool:
    """Whether a MoE layer splits every expert over the TP ranks (TP > 1 without expert parallelism)."""
    return ep_size == 1 and tp_size > 1


def check_moe_layout(tp_size: int, ep_size: int, *, quantized_experts: bool = False,
                     intermediate_size: int | None = None) -> None:
    """Refuse a MoE layer layout the engine cannot run.

    ``ep_size`` is the expert-parallel group size (1: EP off). Raises ``ValueError`` when TP-split
    experts' ``intermediate_size`` does not divide by ``tp_size``, and ``NotImplementedError`` (a
    ``RuntimeError``) when ``quantized_experts`` would be split by tensor parallelism."""
    if not experts_tp_sharded(tp_size, ep_size):
        return
    if intermediate_size is not None and intermediate_size % tp_size:
        raise ValueError(f"expert intermediate size {intermediate_size} does not divide by TP {tp_size}")
    if quantized_experts:
        raise NotImplementedError(QUANTIZED_EXPERTS_TP_MESSAGE)


def check_expert_placement(num_experts: int, num_redundant: int, ep_size: int) -> None:
    """Refuse expert parallelism whose physical experts do not divide over the EP ranks (the rule of
    ``distributed/eplb.py``'s initial placement, same messages)."""
    if ep_size <= 1:
        return
    if num_redundant == 0:
        if num_experts % ep_size:
            raise ValueError(f"{num_experts} experts do not divide over {ep_size} expert-parallel ranks")
    elif (num_experts + num_redundant) % ep_size:
        raise ValueError(f"{num_experts} experts + {num_redundant} redundant do not divide over {ep_size} ranks")


def dp_ep_enabled(data_parallel_size: int, enable_expert_parallel: bool) -> bool:
    """Whether these options ask for attention-DP + EP (DP replicas stepping in lockstep)."""
    return int(data_parallel_size) > 1 and bool(enable_expert_parallel)


def check_dp_ep(data_parallel_size: int, enable_expert_parallel: bool, tensor_parallel_size: int, *,
                speculative: bool = False, async_scheduling: bool = False, eplb: bool = False,
                two_batch_overlap: bool = False) -> None:
    """Refuse the options attention-DP + EP cannot keep in lockstep yet: a ``ValueError`` naming each
    (nothing to check when the options do not ask for that layout)."""
    if not dp_ep_enabled(data_parallel_size, enable_expert_parallel):
        return
    bad = []
    if int(tensor_parallel_size) != 1:
        bad.append(f"--tensor-parallel-size {tensor_parallel_size} (TP 1 per replica only, for now)")
    if speculative:
        bad.append("--speculative-config")
    if async_scheduling:
        bad.append("--async-scheduling")
    if eplb:
        bad.append("--eplb-config")
    if two_batch_overlap:
        bad.append("--enable-two-batch-overlap")
    if bad:
        raise ValueError("--data-parallel-size N --enable-expert-parallel (attention-DP + EP) does not support "
                         + ", ".join(bad))


def check_launch(tensor_parallel_size: int, data_parallel_size: int, gpus_per_node: int | None = None, *,
                 torchrun: bool = False) -> None:
    """Refuse a launch that places data-parallel replicas beyond one node: a ``ValueError``.

    ``torchrun``: ``tokenfab serve`` started by torchrun (one TP group over every rank, on any number of
    nodes), which takes no ``--data-parallel-size``. Otherwise DP x TP ranks must fit on one node of
    ``gpus_per_node`` GPUs (None: not known here, nothing to check); TP alone (DP 1) is not limited."""
    tp, dp = int(tensor_parallel_size), int(data_parallel_size)
    if torchrun and dp != 1:
        raise ValueError(TORCHRUN_DP_MESSAGE)
    if dp > 1 and gpus_per_node is not None and tp * dp > gpus_per_node:
        raise ValueError(f"--data-parallel-size {dp} x --tensor-parallel-size {tp} = {tp * dp} GPUs span more "
                         f"than one node of {gpus_per_node}: data-parallel replicas start on the local node only "
                         "(torchrun, the multi-node launch, runs one TP group and no --data-parallel-size)")
