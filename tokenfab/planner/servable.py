"""Whether the engine serves a layout: ``tokenfab plan`` asks the engine's own admission rules
(``tokenfab.distributed.admission``, the functions ``layers/moe.py``, ``executors/dp_lockstep.py`` and
``server/cli.py`` call) with the options a user would launch that layout with, so a proposed layout is one the engine
accepts. ``docs/parallelism-layouts.md`` explains each refusal."""

from __future__ import annotations

from tokenfab.distributed.admission import check_dp_ep, check_expert_placement, check_launch, check_moe_layout
from tokenfab.planner.quant_bytes import QuantScheme
from tokenfab.planner.spec_types import ModelSpec


def quantized_experts(spec: ModelSpec, scheme: QuantScheme) -> bool:
    """Whether the routed experts run in a quantized format (the checkpoint's; never under online FP8)."""
    return any(scheme.applies(w) for w in spec.weights if w.experts > 1)


def engine_refusal(tp: int, dp: int, ep: bool, *, num_experts: int, redundant_experts: int,
                   moe_intermediate: int, experts_quantized: bool, gpus_per_node: int | None = None) -> str:
    """The engine's message refusing ``TPtp DPdp [EP]`` for this model ("" when it serves it).

    Launched as ``--tensor-parallel-size tp --data-parallel-size dp [--enable-expert-parallel]``, with
    ``--eplb-config`` carrying the redundant experts under EP. Each DP replica is a TP group of its own:
    its MoE layers see TP ``tp`` and EP size ``tp`` (EP over the TP group, DP 1), ``dp`` (attention-DP
    + EP, TP 1) or 1 (no EP). DP > 1 is served on one node of ``gpus_per_node`` GPUs only; TP alone
    spans nodes under torchrun."""
    redundant = redundant_experts if ep else 0
    try:
        check_launch(tp, dp, gpus_per_node)
        check_dp_ep(dp, ep, tp, eplb=redundant > 0)
        if num_experts:
            ep_size = tp * dp if ep else 1
            check_expert_placement(num_experts, redundant, ep_size)
            check_moe_layout(tp, ep_size, quantized_experts=experts_quantized,
                             intermediate_size=moe_intermediate or None)
    except (ValueError, NotImplementedError) as e:
        return str(e)
    return ""
