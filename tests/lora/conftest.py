from __future__ import annotations

import pytest

# before any test module imports peft, which imports triton: Triton's interpreter is chosen at triton's first
# import (kernels/_launch.py), and the tests that run the kernels on CPU (TOKENFAB_KERNELS=triton) need it
import tokenfab.kernels._launch  # noqa: F401
from tests.lora.adapters import ALL_TARGETS, make_peft_adapter
from tests.tiny_models import save_tiny_model, tiny_config, tiny_llama_with_bundled_tokenizer


@pytest.fixture(scope="session")
def lora_setup(tmp_path_factory):
    """(base model dir, the transformers base model, adapters by name): a 2-layer random Llama and
    three PEFT adapters: x (r 8, every projection), y (r 4, q and v only), z (r 16, rsLoRA, MLP only)."""
    root = tmp_path_factory.mktemp("lora")
    base = save_tiny_model(tiny_config("llama", num_hidden_layers=2), root / "base")
    adapters = {
        "x": make_peft_adapter(base, root / "x", 8, ALL_TARGETS, seed=1),
        "y": make_peft_adapter(base, root / "y", 4, ["q_proj", "v_proj"], seed=2),
        "z": make_peft_adapter(base, root / "z", 16, ["gate_proj", "up_proj", "down_proj"], seed=3, use_rslora=True),
    }
    return str(root / "base"), base, adapters


@pytest.fixture(scope="session")
def lora_chat_setup(tmp_path_factory):
    """(model dir, transformers model, tokenizer, adapters): a tiny random Llama with the bundled model's
    tokenizer and chat template (chat and responses need them), and PEFT adapters x (r 8, every
    projection), y (r 4, q and v) and z (r 16, o)."""
    model, tokenizer = tiny_llama_with_bundled_tokenizer(std=0.2)
    root = tmp_path_factory.mktemp("lora-chat")
    model.save_pretrained(str(root / "base"))
    tokenizer.save_pretrained(str(root / "base"))
    adapters = {"x": make_peft_adapter(model, root / "x", 8, ALL_TARGETS, seed=11),
                "y": make_peft_adapter(model, root / "y", 4, ["q_proj", "v_proj"], seed=12),
                "z": make_peft_adapter(model, root / "z", 16, ["o_proj"], seed=13)}
    return str(root / "base"), model, tokenizer, adapters
