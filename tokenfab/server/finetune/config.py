"""Where fine-tuning jobs train and with what: ``FineTuningConfig`` and the server flags that fill it."""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass, field


@dataclass
class FineTuningConfig:
    base_model: str | None = None  # the served model's folder or .gguf (None: the bundled model), trained on
    device: str | None = None  # the training subprocess's device ("cpu", "cuda", "cuda:1"); None: CUDA if any
    python: str = field(default_factory=lambda: sys.executable)  # the interpreter the subprocess runs on
    lease_seconds: float = 30.0  # a running job whose server stopped renewing this long ago is failed
    poll_seconds: float = 2.0  # how often the worker looks for queued jobs (it is also woken at once)
    worker: bool = True  # run the job worker in this process

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> FineTuningConfig | None:
        if getattr(args, "no_fine_tuning", False):
            return None
        return cls(base_model=getattr(args, "model", None), device=getattr(args, "fine_tuning_device", None),
                   lease_seconds=getattr(args, "batch_lease_seconds", 30.0))


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("fine-tuning jobs (/v1/fine_tuning/jobs)")
    g.add_argument("--no-fine-tuning", action="store_true", help="do not offer /v1/fine_tuning/jobs")
    g.add_argument("--fine-tuning-device", default=None,
                   help="device of the training subprocess (cpu, cuda, cuda:1; default: CUDA if present). The job "
                   "runs in its own process, outside the engine's memory budget: on a GPU the engine already fills, "
                   "give it another one or cpu")
