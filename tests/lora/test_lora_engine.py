"""Multi-LoRA in the engine: greedy tokens of requests with different adapters (and none) mixed in
one batch equal transformers' with that adapter merged by PEFT; the prefix cache never shares blocks
between adapters; host LRU eviction; bad adapters refused before anything is queued."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from tests.lora.adapters import assert_prompt_logprobs_equal_peft_merged, merged_greedy, run_greedy
from tokenfab import LLM
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.requests.lora_request import LoRARequest
from tokenfab.engine.requests.sampling_params import SamplingParams

peft = pytest.importorskip("peft")

PROMPTS = [[5, 17, 33, 2, 90, 41, 7], [100, 3, 250, 19], [8, 8, 61, 200, 13, 77, 31, 5, 9, 300, 12], [44, 1]]
N_NEW = 8


def _engine(base_dir: str, **kw) -> LLMEngine:
    args = dict(model=base_dir, device="cpu", dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=16,
                num_kv_blocks=64, block_size=4)
    args.update(kw)
    return LLMEngine(**args)


def _run(engine: LLMEngine, jobs: list[tuple[list[int], LoRARequest | None]]) -> list[list[int]]:
    return run_greedy(engine, jobs, N_NEW)


def _req(adapters, name: str, int_id: int) -> LoRARequest:
    return LoRARequest(name, int_id, str(adapters[name]))


@pytest.fixture(scope="module")
def references(lora_setup):
    _, base, adapters = lora_setup
    refs = {None: merged_greedy(base, None, PROMPTS, N_NEW)}
    for name, path in adapters.items():
        refs[name] = merged_greedy(base, path, PROMPTS, N_NEW)
    return refs


def test_mixed_batch_equals_peft_merged(lora_setup, references):
    base_dir, _, adapters = lora_setup
    engine = _engine(base_dir)
    ids = {"x": 1, "y": 2, "z": 3}
    names = [None, "x", "y", "z"]
    # every prompt under every adapter and the base, all in one batch
    jobs = [(p, None if n is None else _req(adapters, n, ids[n])) for p in PROMPTS for n in names]
    got = _run(engine, jobs)
    for (p, lora), tokens in zip(jobs, got):
        name = None if lora is None else lora.lora_name
        assert tokens == references[name][PROMPTS.index(p)], (name, p)
    assert references["x"] != references[None]  # the adapters change the output (the test can fail)
    assert references["y"] != references[None] and references["z"] != references[None]


def test_alone_equals_peft_merged(lora_setup, references):
    base_dir, _, adapters = lora_setup
    engine = _engine(base_dir, max_loras=1)
    for n, lid in (("x", 1), ("z", 3)):
        got = _run(engine, [(PROMPTS[0], _req(adapters, n, lid))])
        assert got[0] == references[n][0]


def test_more_adapters_than_slots_wait_their_turn(lora_setup, references):
    """--max-loras 1: three adapters and the base in one submission; each step holds one adapter."""
    base_dir, _, adapters = lora_setup
    engine = _engine(base_dir, max_loras=1)
    jobs = [(PROMPTS[1], None), (PROMPTS[1], _req(adapters, "x", 1)), (PROMPTS[1], _req(adapters, "y", 2)),
            (PROMPTS[1], _req(adapters, "z", 3))]
    got = _run(engine, jobs)
    assert got == [references[None][1], references["x"][1], references["y"][1], references["z"][1]]


def test_prefix_cache_not_shared_between_adapters(lora_setup, references):
    base_dir, _, adapters = lora_setup
    engine = _engine(base_dir)
    long = PROMPTS[2]
    assert _run(engine, [(long, None)]) == [references[None][2]]
    hits = engine.block_manager.prefix_hits
    # same prompt, adapter x: no block of the base's may serve it
    assert _run(engine, [(long, _req(adapters, "x", 1))]) == [references["x"][2]]
    assert engine.block_manager.prefix_hits == hits
    # and again with x: now its own blocks hit
    assert _run(engine, [(long, _req(adapters, "x", 1))]) == [references["x"][2]]
    assert engine.block_manager.prefix_hits > hits
    hits = engine.block_manager.prefix_hits
    assert _run(engine, [(long, _req(adapters, "y", 2))]) == [references["y"][2]]
    assert engine.block_manager.prefix_hits == hits


def test_host_lru_eviction_reloads(lora_setup, references):
    base_dir, _, adapters = lora_setup
    engine = _engine(base_dir, max_loras=1, max_cpu_loras=2)
    lm = engine.lora
    for n, lid in (("x", 1), ("y", 2)):
        assert _run(engine, [(PROMPTS[0], _req(adapters, n, lid))])[0] == references[n][0]
    assert lm.loaded_ids() == [1, 2] and lm.num_loads == 2
    assert _run(engine, [(PROMPTS[0], _req(adapters, "z", 3))])[0] == references["z"][0]
    assert lm.loaded_ids() == [2, 3]  # x, the least recently used, was dropped
    assert _run(engine, [(PROMPTS[0], _req(adapters, "x", 1))])[0] == references["x"][0]
    assert lm.loaded_ids() == [3, 1] and lm.num_loads == 4  # read again from disk


def test_bad_adapters_are_refused(lora_setup, tmp_path):
    base_dir, _, adapters = lora_setup
    engine = _engine(base_dir, max_lora_rank=8)
    params = SamplingParams(max_tokens=2)
    with pytest.raises(ValueError, match="--max-lora-rank"):
        engine.add_request("a", PROMPTS[0], params, lora_request=_req(adapters, "z", 3))
    with pytest.raises(ValueError, match="lora_path"):
        engine.add_request("b", PROMPTS[0], params, lora_request=LoRARequest("nope", 9, str(tmp_path / "missing")))
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        engine.add_request("c", PROMPTS[0], params, lora_request=LoRARequest("junk", 10, str(tmp_path / "junk")))
    assert not engine.has_unfinished_requests()
    plain = LLMEngine(model=base_dir, device="cpu", dtype="float32", num_kv_blocks=16)
    with pytest.raises(ValueError, match="--enable-lora"):
        plain.add_request("d", PROMPTS[0], params, lora_request=_req(adapters, "x", 1))


def test_prompt_logprobs_equal_peft_merged(lora_setup):
    """Prompt logprobs (prefill rows) of adapter requests mixed with the base: within 1e-4 of transformers
    with the adapter merged by PEFT (fp32)."""
    base_dir, base, adapters = lora_setup
    engine = _engine(base_dir)
    jobs = {"b": None, "x": _req(adapters, "x", 1), "z": _req(adapters, "z", 3)}
    assert_prompt_logprobs_equal_peft_merged(engine, base, PROMPTS[2], jobs)


def test_mixed_batch_through_the_triton_kernels(lora_setup, references, monkeypatch):
    """TOKENFAB_KERNELS=triton: every op of the step, lora_delta included, through the Triton kernels (the
    interpreter on CPU); the same greedy tokens as PEFT merged."""
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    base_dir, _, adapters = lora_setup
    engine = _engine(base_dir, cpu_weight_packing=False)
    jobs = [(PROMPTS[3], None), (PROMPTS[3], _req(adapters, "x", 1)), (PROMPTS[1], _req(adapters, "y", 2))]
    assert _run(engine, jobs) == [references[None][3], references["x"][3], references["y"][1]]


def test_llm_generate_with_a_lora_request(lora_setup, references):
    base_dir, _, adapters = lora_setup
    llm = LLM(base_dir, device="cpu", dtype="float32", enable_lora=True, num_kv_blocks=64, block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=N_NEW, ignore_eos=True)
    out = llm.generate(PROMPTS[:2], params, lora_request=_req(adapters, "y", 2))
    assert [list(o.outputs[0].token_ids) for o in out] == references["y"][:2]
    assert [list(o.outputs[0].token_ids) for o in llm.generate(PROMPTS[:2], params)] == references[None][:2]


@pytest.mark.parametrize("tensors,fragment", [
    ({"base_model.model.lm_head.lora_A.weight": (4, 64), "base_model.model.lm_head.lora_B.weight": (320, 4)},
     "not a LoRA target"),
    ({"base_model.model.model.embed_tokens.lora_embedding_A": (4, 320)}, "not a LoRA A/B weight"),
    ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (4, 64)}, "needs lora_A and lora_B"),
    ({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": (4, 65),
      "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": (64, 4)}, "do not fit"),
    ({"base_model.model.model.layers.9.mlp.up_proj.lora_A.weight": (4, 64),
      "base_model.model.model.layers.9.mlp.up_proj.lora_B.weight": (128, 4)}, "not a LoRA target"),
    ({}, "no LoRA tensors"),
])
def test_hand_made_bad_adapters_are_refused(lora_setup, tmp_path, tensors, fragment):
    base_dir, _, _ = lora_setup
    engine = _engine(base_dir)
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4, "lora_alpha": 8}')
    save_file({k: torch.ones(s) for k, s in tensors.items()}, str(tmp_path / "a" / "adapter_model.safetensors"))
    with pytest.raises(ValueError, match=fragment):
        engine.add_request("r", PROMPTS[0], SamplingParams(max_tokens=1),
                           lora_request=LoRARequest("a", 5, str(tmp_path / "a")))
    assert not engine.has_unfinished_requests() and engine.lora.loaded_ids() == []
