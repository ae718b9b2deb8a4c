"""Multi-LoRA on the bundled packed-GGUF model on CPU, whose steps run in C (``models/llama_native.py``):
a step without adapters still runs there, a step with one runs the Python layers with the deltas, and
in a mixed batch each request gets what it gets alone."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.requests.lora_request import LoRARequest
from tokenfab.engine.requests.sampling_params import SamplingParams

PROMPTS = [[1, 504, 3458, 282, 4649, 314], [2, 77, 1900, 42]]
N_NEW = 4


def _adapter(path, cfg, r: int = 4) -> str:
    """A PEFT-layout adapter on q_proj and down_proj of every layer, written by hand for the model's shapes."""
    g = torch.Generator().manual_seed(5)
    h, inter, n = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers
    tensors = {}
    for i in range(n):
        for mod, k, out in (("self_attn.q_proj", h, h), ("mlp.down_proj", inter, h)):
            key = f"base_model.model.model.layers.{i}.{mod}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(r, k, generator=g) * 0.05
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, r, generator=g) * 0.05
    path.mkdir()
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": r, "lora_alpha": 2 * r,
                                                          "target_modules": ["q_proj", "down_proj"]}))
    return str(path)


def _run(engine, jobs):
    params = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
    for i, (ids, lora) in enumerate(jobs):
        engine.add_request(f"r{i}", ids, params, lora_request=lora)
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    return [out[f"r{i}"] for i in range(len(jobs))]


def test_native_step_for_base_python_layers_for_adapters(tmp_path):
    engine = LLMEngine(enable_lora=True, max_model_len=256, num_kv_blocks=64, max_lora_rank=8)
    lora = LoRARequest("a", 1, _adapter(tmp_path / "a", engine.model.config))
    base_alone = _run(engine, [(p, None) for p in PROMPTS])
    step = getattr(engine.model, "_native_step", None)
    assert step is not None and step.why_not is None  # the base steps ran in C
    with_adapter = _run(engine, [(p, lora) for p in PROMPTS])
    assert with_adapter != base_alone  # the delta was applied (the C step would have ignored it)
    mixed = _run(engine, [(PROMPTS[0], lora), (PROMPTS[0], None), (PROMPTS[1], None), (PROMPTS[1], lora)])
    assert mixed == [with_adapter[0], base_alone[0], base_alone[1], with_adapter[1]]
