"""EPLB in the engine (tokenfab/executors/eplb_engine.py): --eplb-config, the step schedule, the
lockstep rebalance on every TP rank.

Fast tier: the config's parsing and errors (EngineArgs, the CLI), the schedule of resets and
rebalances, the controller's actions in order (sent to the workers first, then applied), a dense
model / EP size 1 refused. Slow tier: ``LLM(tensor_parallel_size=2, enable_expert_parallel=True,
eplb_config=...)`` on tiny Qwen3-MoE rebalances several times mid-generation and still gives one
process's greedy tokens, and its placement really moved.
"""

from __future__ import annotations

import argparse

import pytest
import torch
from torch import nn

from tokenfab.engine.args import EngineArgs
from tokenfab.executors.eplb_engine import (
    ACTION_REBALANCE,
    ACTION_RESET,
    EplbConfig,
    EplbController,
    redundant_experts,
)


def test_parse_and_errors():
    cfg = EplbConfig.parse('{"num_redundant_experts": 2, "step_interval": 10, "window_size": 4}')
    assert cfg == EplbConfig(2, 10, 4)
    assert EplbConfig.parse({"num_redundant_experts": 1}) == EplbConfig(1, 3000, 1000)  # vLLM's defaults
    assert EplbConfig.parse(None) is None
    for bad, msg in [('{"num_redundant_experts": -1}', ">= 0"), ('{"step_interval": 0}', ">= 1"),
                     ('{"num_redundant": 2}', "unknown keys"), ('{"window_size": 2.5}', "integer"),
                     ("[1, 2]", "JSON object"), ("{oops", "not valid JSON")]:
        with pytest.raises(ValueError, match=msg):
            EplbConfig.parse(bad)
    with pytest.raises(ValueError, match="--enable-expert-parallel"):
        EngineArgs(eplb_config={"num_redundant_experts": 2})
    with pytest.raises(ValueError, match=">= 0"):
        EngineArgs(enable_expert_parallel=True, eplb_config={"num_redundant_experts": -2})
    # the CLI flag lands in EngineArgs and R reaches init_expert_parallel through redundant_experts
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    ns = parser.parse_args(["m", "-tp", "2", "--enable-expert-parallel", "--eplb-config",
                            '{"num_redundant_experts": 2, "step_interval": 5}'])
    args = EngineArgs.from_cli_args(ns)
    assert redundant_experts(args) == 2 and EplbConfig.parse(args.eplb_config).step_interval == 5
    assert redundant_experts(EngineArgs()) == 0


def test_schedule_tumbling_window():
    acts = {s: EplbConfig(0, 5, 2).action(s) for s in range(1, 16)}
    assert {s for s, a in acts.items() if a == ACTION_REBALANCE} == {5, 10, 15}
    assert {s for s, a in acts.items() if a == ACTION_RESET} == {3, 8, 13}  # the last 2 steps counted
    assert all(EplbConfig(0, 4, 9).action(s) != ACTION_RESET for s in range(1, 20))  # W >= N: no extra reset


class _FakeMoE(nn.Module):
    """What the controller touches on a FusedMoE: placement, expert_load, rebalance()."""

    def __init__(self, log: list) -> None:
        super().__init__()
        self.placement, self.log = object(), log
        self.expert_load = torch.ones(4, dtype=torch.int64)

    def rebalance(self) -> None:
        self.log.append(("rebalance", id(self)))
        self.expert_load.zero_()


def test_controller_runs_due_actions_in_order(monkeypatch):
    import tokenfab.executors.eplb_engine as eng

    log: list = []
    layers = [_FakeMoE(log), _FakeMoE(log)]
    monkeypatch.setattr(eng, "moe_layers", lambda model: layers)
    ctl = EplbController(EplbConfig(0, 4, 1), nn.Linear(1, 1), send=lambda a: log.append(("send", a)))
    ctl.on_steps(2)
    assert log == [] and all(int(m.expert_load.sum()) == 4 for m in layers)
    ctl.on_steps(3)  # step 3: the window opens (counters reset, the workers told first)
    assert log == [("send", ACTION_RESET)] and all(int(m.expert_load.sum()) == 0 for m in layers)
    ctl.on_steps(3)  # nothing new
    ctl.on_steps(4)
    assert log[1:] == [("send", ACTION_REBALANCE), ("rebalance", id(layers[0])), ("rebalance", id(layers[1]))]
    assert ctl.num_rebalances == 1


def test_dense_model_and_single_rank_refused(monkeypatch):
    import tokenfab.executors.eplb_engine as eng

    with pytest.raises(ValueError, match="no MoE layers"):
        EplbController(EplbConfig(2), nn.Sequential(nn.Linear(2, 2)))
    layer = _FakeMoE([])
    layer.placement = None  # EP size 1: nothing to place
    monkeypatch.setattr(eng, "moe_layers", lambda model: [layer])
    with pytest.raises(ValueError, match="more than one rank"):
        EplbController(EplbConfig(2), nn.Linear(1, 1))


# ---------------------------------------------------------------- slow: the launch path

ENGINE_ARGS = dict(block_size=4, num_kv_blocks=14, max_num_batched_tokens=8, max_num_seqs=4)
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11], [5, 17, 42, 99, 3, 250, 7, 8, 1, 2],
           list(range(30, 52)), [7, 8]]


@pytest.mark.slow
@pytest.mark.parametrize("weights", ["plain", "nvfp4"])
def test_llm_tp2_ep_rebalances_and_keeps_tokens(tmp_path, weights):
    """TP 2 + EP 2 with 2 redundant experts, a rebalance every 3 steps from the last 2 steps' load: the
    greedy tokens equal one process's across the rebalances (prefix caching, chunked prefill and
    preemption on), and the layers' log2phy moved away from the initial placement. ``nvfp4``: the
    experts are NVFP4 (each rank builds its 5 local slots, and the packed buffers move on rebalance)."""
    from tests.moe_tiny_models import tiny_moe_config
    from tests.tiny_models import save_tiny_model
    from tokenfab import LLM, SamplingParams
    from tokenfab.distributed import parallel_state as ps
    from tokenfab.distributed.eplb import identity_placement
    from tokenfab.executors.eplb_engine import moe_layers

    save_tiny_model(tiny_moe_config("qwen3_moe"), tmp_path / "plain")
    path = tmp_path / "plain"
    if weights == "nvfp4":
        from tests.quant.layouts_w4 import write_nvfp4_checkpoint

        path = tmp_path / "nvfp4"
        write_nvfp4_checkpoint(tmp_path / "plain", path, exclude=["lm_head", "model.layers.*.mlp.gate"])
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)

    def run(**kw):
        llm = LLM(model=str(path), **ENGINE_ARGS, **kw)
        try:
            tokens = [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS, params)]
            eng = llm.engine
            maps = [m.log2phy.clone() for m in moe_layers(eng.model)] if eng.eplb is not None else []
            if weights == "nvfp4":
                from tokenfab.quant.nvfp4 import Nvfp4Experts

                for m in moe_layers(eng.model):
                    assert isinstance(m.quant_experts, Nvfp4Experts)
                    assert m.quant_experts.w13_q.shape[0] == m.num_local_experts and not m.quant_experts.missing()
            return tokens, maps, (eng.eplb.num_rebalances if eng.eplb else 0), eng.scheduler.num_preemptions_total
        finally:
            llm.shutdown()

    one, _, _, _ = run()
    eplb = {"num_redundant_experts": 2, "step_interval": 3, "window_size": 2}
    tokens, maps, rebalances, preempted = run(tensor_parallel_size=2, enable_expert_parallel=True, eplb_config=eplb)
    assert tokens == one
    assert rebalances >= 3 and preempted > 0
    initial = identity_placement(8, 2, 2).log2phy
    assert len(maps) == 2 and any(m.shape != initial.shape or not torch.equal(m, initial) for m in maps)
    assert ps.get_parallel_state().ep_size == 1
