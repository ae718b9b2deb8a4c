"""EPLB in the engine: ``--eplb-config`` and the periodic rebalance of every MoE layer between steps.

``--eplb-config`` takes vLLM's shape, a JSON object (or a dict from the Python API)::

    {"num_redundant_experts": R, "step_interval": N, "window_size": W}

R extra physical experts per MoE layer (replicas of the hottest experts; ``E + R`` must divide over
the EP ranks), a rebalance every N engine steps (model forwards), from the expert load of the last
``min(W, N)`` steps. The load window is a *tumbling* one, not a sliding one: every rank's counters
(``FusedMoE.expert_load``) restart after each rebalance and, when W < N, once more W steps before the
next rebalance, so a rebalance sees the tokens routed in its last W steps and nothing older. That
costs nothing per step (no ring of per-step counters) and keeps the counters on the device.

Lockstep: rank 0 (the engine) counts the steps and decides; under tensor parallelism it sends the
action to the workers as a command between two forwards (``TPExecutor.send_eplb``), and each rank
then does the same thing to its own layers in the same order, so ``FusedMoE.rebalance``'s
collectives (the load all-reduce, the weight all-gathers) meet.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from torch import nn

from tokenfab.engine.requests.errors import parse_json_option
from tokenfab.layers.moe import FusedMoE

ACTION_RESET, ACTION_REBALANCE = 1, 2
_KEYS = ("num_redundant_experts", "step_interval", "window_size")


@dataclass(frozen=True)
class EplbConfig:
    num_redundant_experts: int = 0
    step_interval: int = 3000  # vLLM's defaults
    window_size: int = 1000

    @classmethod
    def parse(cls, value: str | dict | EplbConfig | None) -> EplbConfig | None:
        """A JSON string, a dict or a config -> a checked config; None stays None (EPLB off)."""
        if value is None or isinstance(value, EplbConfig):
            return value
        if isinstance(value, str):
            value = parse_json_option(value, "eplb_config")
        if not isinstance(value, dict):
            raise ValueError(f"eplb_config must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - set(_KEYS))
        if unknown:
            raise ValueError(f"eplb_config: unknown keys {unknown} (known: {list(_KEYS)})")
        for k, v in value.items():
            if isinstance(v, bool) or not isinstance(v, int):
                raise ValueError(f"eplb_config: {k} must be an integer, got {v!r}")
        cfg = cls(**value)
        if cfg.num_redundant_experts < 0:
            raise ValueError(f"eplb_config: num_redundant_experts must be >= 0, got {cfg.num_redundant_experts}")
        if cfg.step_interval < 1 or cfg.window_size < 1:
            raise ValueError("eplb_config: step_interval and window_size must be >= 1")
        return cfg

    def action(self, step: int) -> int | None:
        """What to do once ``step`` steps have run (step >= 1): rebalance, reset the counters, or nothing."""
        n, w = self.step_interval, self.window_size
        if step % n == 0:
            return ACTION_REBALANCE
        if w < n and step % n == n - w:
            return ACTION_RESET
        return None


def redundant_experts(args: Any) -> int:
    """R from an EngineArgs-like object (0 when EPLB is off)."""
    cfg = EplbConfig.parse(getattr(args, "eplb_config", None))
    return 0 if cfg is None else cfg.num_redundant_experts


def moe_layers(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(m, FusedMoE)]


def apply_action(layers: list[nn.Module], action: int) -> None:
    """One rank's part of an action, layer by layer (the same order on every rank)."""
    for m in layers:
        if action == ACTION_REBALANCE:
            m.rebalance()  # restarts the layer's counter too
        elif action == ACTION_RESET:
            m.expert_load.zero_()
        else:
            raise ValueError(f"unknown EPLB action {action}")


class EplbController:
    """Rank 0's side: counts the engine's steps and runs (and broadcasts) the actions due."""

    def __init__(self, config: EplbConfig, model: nn.Module, send: Callable[[int], None] | None = None) -> None:
        self.config = config
        self.layers = moe_layers(model)
        if not self.layers:
            raise ValueError("eplb_config is set but the model has no MoE layers (EPLB places experts)")
        if any(m.placement is None for m in self.layers):
            raise ValueError("eplb_config needs expert parallelism over more than one rank "
                             "(--enable-expert-parallel with --tensor-parallel-size > 1)")
        self.send = send  # TPExecutor.send_eplb under tensor parallelism
        self.seen = 0
        self.num_rebalances = 0

    def on_steps(self, num_steps: int) -> None:
        """Called between steps with the engine's step count; runs what fell due since the last call."""
        for step in range(self.seen + 1, num_steps + 1):
            action = self.config.action(step)
            if action is None:
                continue
            if self.send is not None:
                self.send(action)
            apply_action(self.layers, action)
            self.num_rebalances += action == ACTION_REBALANCE
        self.seen = max(self.seen, num_steps)
