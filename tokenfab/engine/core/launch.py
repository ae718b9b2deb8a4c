"""Starting an engine-core process (``python -m tokenfab.engine.core.process``) for a front end to
connect to (``EngineCoreClient.connect``); under data parallelism several start at once."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from tokenfab.engine.args import EngineArgs
from tokenfab.loader.bundled import bundled_model_path
from tokenfab.loader.gguf import load_gguf_tokenizer
from tokenfab.loader.model_loader import _hf_tokenizer


def load_tokenizer(model: str | None) -> Any:
    """The tokenizer of ``model`` (as ``load_model`` finds it), without the weights."""
    path = Path(model) if model is not None else bundled_model_path()
    if path.is_file() and path.suffix == ".gguf":
        return load_gguf_tokenizer(path)
    return _hf_tokenizer(path)


@dataclasses.dataclass
class CoreLaunch:
    """An engine-core process started but not yet connected to (several start at once under DP)."""

    proc: subprocess.Popen
    address: str
    workdir: str

    @classmethod
    def start(cls, args: EngineArgs, log_level: str = "info", env: dict[str, str] | None = None) -> CoreLaunch:
        workdir = tempfile.mkdtemp(prefix="tokenfab-core-")
        address = f"ipc://{workdir}/core.sock"
        engine_args = dataclasses.asdict(args)
        cmd = [sys.executable, "-m", "tokenfab.engine.core.process", "--address", address,
               "--args-json", json.dumps(engine_args), "--parent-pid", str(os.getpid()), "--log-level", log_level]
        return cls(subprocess.Popen(cmd, env=env), address, workdir)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)
