from __future__ import annotations

import pytest

from tests.tiny_models import save_tiny_model, tiny_config


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A 2-layer random Llama (vocab 320) saved as safetensors."""
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model(tiny_config("llama", num_hidden_layers=2, max_position_embeddings=1024), path)
    return str(path)
