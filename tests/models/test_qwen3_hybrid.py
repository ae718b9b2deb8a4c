"""Qwen3-Next and Qwen3.5 (dense, MoE, and the VL wrappers served text only), tiny random fp32 checkpoints in
the official layouts (tests/models/hybrid_models.py), run through our model with its state slots bound, on
hand-built flat batches: logits equal transformers' (the full sequence, no cache) at the prefill and over 8
decode steps, alone and in mixed batches (chunked prefills across the kernel's 64-token chunk boundary beside
decodes, a one-token prompt arriving in a decode step, state slots reused from finished sequences)."""

from __future__ import annotations

import pytest
import torch

from tests.models.hybrid_models import FAMILIES, WRAPPERS, HybridDriver, save_tiny_hybrid, tiny_hybrid_config
from tests.tiny_models import hf_logits, randomize_
from tokenfab.layers.gated_deltanet import GatedDeltaNet
from tokenfab.layers.moe import FusedMoE
from tokenfab.models.qwen3_next import GatedAttention

ATOL = 1e-3  # fp32 logits, as every tiny-model comparison here
# 70 tokens: past the prefill kernel's 64-token chunk; 1 token: a prompt that is its own decode-sized step
PROMPTS = [list(range(5, 75)), [17, 42, 99], [250]]
DECODE_STEPS = 8


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny matrices: one thread is far faster on a shared machine (the engines run one too)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def tiny(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = save_tiny_hybrid(request.param, path)
    return request.param, hf, path


def _assert_matches_hf(hf, seq, prompt_len: int, what: str) -> None:
    """Each logits row the seq collected (prompt end, then one per decode) equals transformers' at its position,
    and each generated token is transformers' argmax."""
    ref = hf_logits(hf, seq.tokens[: prompt_len + len(seq.logits) - 1])
    for s, logits in enumerate(seq.logits):
        pos = prompt_len - 1 + s
        torch.testing.assert_close(logits, ref[pos], atol=ATOL, rtol=0, msg=lambda m, s=s: f"{what}, step {s}: {m}")
        if pos + 1 < len(seq.tokens):
            assert seq.tokens[pos + 1] == int(ref[pos].argmax()), f"{what}, step {s}"


def test_model_structure(tiny, caplog):
    """3 Gated DeltaNet layers then a gated-attention one; MoE where the family has it (Qwen3-Next: layer 1
    dense by mlp_only_layers); the VL wrappers load no vision weights, and say so."""
    family, _, path = tiny
    with caplog.at_level("WARNING", logger="tokenfab.models.qwen3_5"):
        model = HybridDriver(path, num_slots=1).model
    said = [r.getMessage() for r in caplog.records if "vision tower" in r.getMessage()]
    assert len(said) == (1 if family in WRAPPERS else 0), said
    if said:
        assert "text only" in said[0]
    layers = model.model.layers
    assert [type(getattr(x, "linear_attn", None) or x.self_attn) for x in layers] == [GatedDeltaNet] * 3 + [
        GatedAttention]
    moe = [isinstance(x.mlp, FusedMoE) for x in layers]
    assert moe == {"qwen3_next": [True, False, True, True], "qwen3_5_moe_text": [True] * 4,
                   "qwen3_5_moe": [True] * 4}.get(family, [False] * 4)
    assert all(x.mlp.shared_experts is not None and x.mlp.shared_expert_gate is not None
               for x in layers if isinstance(x.mlp, FusedMoE))
    assert not any("visual" in n for n, _ in model.named_parameters())


def test_prefill_and_decode_logits_match_transformers(tiny):
    _, hf, path = tiny
    driver = HybridDriver(path, num_slots=2)
    for i, prompt in enumerate(PROMPTS):
        seq = driver.new_seq(prompt, slot=i % 2)  # slot 0 reused: the third prompt starts over stale state
        driver.step([(seq, len(prompt))])
        for _ in range(DECODE_STEPS):
            driver.greedy(seq)
            driver.step([(seq, 1)])
        _assert_matches_hf(hf, seq, len(prompt), f"prompt {i} alone")


def run_schedule(driver: HybridDriver, prompts: list[list[int]], arrivals: list[int], chunk: int, max_tokens: int,
                 num_slots: int) -> tuple[list, set[str]]:
    """A tiny scheduler: prompt i joins at step ``arrivals[i]`` when a slot is free; each step takes up to
    ``chunk`` prompt tokens of every prefilling sequence and one token of every decoding one; a sequence
    leaves after ``max_tokens`` tokens and frees its slot (its state left behind). Returns the seqs and the
    step kinds reached: "chunked", "mixed" (prefill and decode rows), "reused-slot", "decode-fresh-reused" (a
    new one-token prompt, in a slot a finished sequence left its state in, in a decode-only step)."""
    free, seqs, active, kinds = list(range(num_slots)), [None] * len(prompts), [], set()
    used: set[int] = set()
    reused: set[int] = set()  # ids of seqs whose slot held an earlier sequence's state
    step = 0
    while step <= max(arrivals) or active or None in seqs:
        for i, at in enumerate(arrivals):
            if seqs[i] is None and at <= step and free:
                slot = free.pop(0)
                seqs[i] = driver.new_seq(prompts[i], slot)
                if slot in used:
                    kinds.add("reused-slot")
                    reused.add(id(seqs[i]))
                used.add(slot)
                active.append((seqs[i], len(prompts[i])))
        work = []
        for seq, plen in active:
            n = min(chunk, plen - seq.computed) if seq.computed < plen else 1
            kinds |= {"chunked"} if 0 < seq.computed < plen else set()
            work.append((seq, n))
        if work:
            q = [n for _, n in work]
            if max(q) > 1 and any(s.computed >= p for s, p in active):
                kinds.add("mixed")
            if max(q) == 1 and len(work) > 1 and any(s.computed == 0 and id(s) in reused for s, _ in work):
                kinds.add("decode-fresh-reused")
            driver.step(work)
            done = []
            for seq, plen in active:
                if seq.computed >= plen:
                    if len(seq.tokens) - plen < max_tokens:
                        driver.greedy(seq)
                    else:
                        done.append(seq)
            for seq in done:
                free.append(seq.slot)
            active = [(s, p) for s, p in active if s not in done]
        step += 1
    return seqs, kinds


# 3 slots for 5 requests: later ones reuse slots; the 70-token prompt prefills in 24-token chunks beside a
# 13-token prefill and decodes; the one-token prompt arrives, in a freed slot, when only decodes run
SCHEDULE_PROMPTS = [list(range(5, 75)), [17, 42, 99, 3, 250, 7, 8, 9, 10], list(range(100, 113)), [250], [1, 2]]
SCHEDULE_ARRIVALS = [0, 0, 1, 7, 8]


def _check_schedule(hf, driver, chunk: int = 24, max_tokens: int = 6) -> None:
    seqs, kinds = run_schedule(driver, SCHEDULE_PROMPTS, SCHEDULE_ARRIVALS, chunk, max_tokens, num_slots=3)
    assert {"chunked", "mixed", "reused-slot", "decode-fresh-reused"} <= kinds, kinds
    for i, (seq, prompt) in enumerate(zip(seqs, SCHEDULE_PROMPTS)):
        n_chunks = -(-len(prompt) // chunk)
        seq.logits = seq.logits[n_chunks - 1:]  # from the prompt's last chunk on
        assert len(seq.tokens) == len(prompt) + max_tokens
        _assert_matches_hf(hf, seq, len(prompt), f"request {i} in the schedule")


def test_chunked_mixed_batches_with_reused_slots_match_transformers(tiny):
    _, hf, path = tiny
    _check_schedule(hf, HybridDriver(path, num_slots=3))


def _triton_driver(path, monkeypatch) -> HybridDriver:
    from tokenfab.kernels._launch import interpreting

    if not (torch.cuda.is_available() or interpreting()):
        pytest.skip("triton was imported without the interpreter")
    driver = HybridDriver(path, num_slots=3)
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    return driver


@pytest.mark.slow
def test_through_triton_kernels(tmp_path, monkeypatch):
    """The schedule above with every op on its Triton kernel (the interpreter on CPU): the gated-delta
    prefill (two 64-token chunks of one prompt) and decode, both conv kernels, paged attention with partial
    RoPE, the fused MoE. Slow (~75 s on the shared machine); its fast twin below runs the same kernels on a
    short schedule."""
    hf = save_tiny_hybrid("qwen3_5_moe", tmp_path)
    _check_schedule(hf, _triton_driver(tmp_path, monkeypatch))


def test_through_triton_kernels_short(tmp_path, monkeypatch):
    """Fast twin (dense Qwen3.5: the fused MoE's interpreter run is tested with the MoE models): a 5-token
    prompt prefilled in 3 + 2 tokens beside a decode, then a fresh one-token prompt in a decode step on a slot
    a finished sequence used, every op on its Triton kernel."""
    hf = save_tiny_hybrid("qwen3_5_text", tmp_path)
    driver = _triton_driver(tmp_path, monkeypatch)
    a, b = driver.new_seq([3, 1, 4], slot=0), driver.new_seq([9, 2, 6, 5, 3], slot=1)
    driver.step([(a, 3), (b, 3)])
    driver.greedy(a)
    driver.step([(a, 1), (b, 2)])  # mixed: a decode beside b's second chunk
    driver.greedy(a), driver.greedy(b)
    driver.step([(a, 1), (b, 1)])
    c = driver.new_seq([7], slot=0)  # a's slot, a done: its state left behind
    driver.greedy(b)
    driver.step([(b, 1), (c, 1)])  # decode-only step with a fresh sequence
    driver.greedy(b), driver.greedy(c)
    driver.step([(b, 1), (c, 1)])
    b.logits = b.logits[1:]  # from the prompt's last chunk on
    for seq, plen, what in ((a, 3, "a"), (b, 5, "b"), (c, 1, "c")):
        _assert_matches_hf(hf, seq, plen, what)

@pytest.mark.parametrize("family", ["qwen3_5", "qwen3_5_moe"])
def test_written_layout_is_the_one_transformers_reads(family, tmp_path):
    """The wrappers' layouts (Qwen3.5-MoE's with stacked experts and an MTP layer, as released) load into
    transformers' VL class with no missing or unexpected tensor and the same logits as the model written."""
    import transformers

    hf = save_tiny_hybrid(family, tmp_path)
    loaded, info = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path, dtype=torch.float32,
                                                                            output_loading_info=True)
    assert type(loaded).__name__ == type(hf).__name__
    assert not any(info.values()), info
    ids = PROMPTS[0][:20]
    torch.testing.assert_close(hf_logits(loaded.eval(), ids), hf_logits(hf, ids), atol=0, rtol=0)


@pytest.mark.parametrize("wrapper_tie, text_tie", [(True, True), (False, True)])
def test_wrapper_ties_embeddings_as_its_top_level_config_says(wrapper_tie, text_tie, tmp_path):
    """transformers ties a VL wrapper's LM head to the embeddings by the top-level ``tie_word_embeddings``
    (the Qwen3.5 small releases tie), whatever the text config says; so do we."""
    import json

    import transformers

    config = tiny_hybrid_config("qwen3_5", tie_word_embeddings=text_tie)
    config.tie_word_embeddings = wrapper_tie
    torch.manual_seed(0)
    hf = randomize_(transformers.AutoModelForImageTextToText.from_config(config, dtype=torch.float32))
    hf.tie_weights()
    hf.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert (saved["tie_word_embeddings"], saved["text_config"]["tie_word_embeddings"]) == (wrapper_tie, text_tie)
    driver = HybridDriver(tmp_path, num_slots=1)
    model = driver.model
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == wrapper_tie
    seq = driver.new_seq(PROMPTS[1], slot=0)
    driver.step([(seq, len(PROMPTS[1]))])
    torch.testing.assert_close(seq.logits[0], hf_logits(hf, PROMPTS[1])[-1], atol=ATOL, rtol=0)


def test_missing_or_misshapen_tensor_is_a_clear_error(tmp_path):
    from safetensors.torch import load_file, save_file

    from tokenfab.loader.errors import ModelLoadError

    save_tiny_hybrid("qwen3_next", tmp_path)
    file = tmp_path / "model.safetensors"
    tensors = load_file(str(file))
    good = dict(tensors)
    del tensors["model.layers.2.linear_attn.A_log"]
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="missing.*layers.2.linear_attn.A_log"):
        HybridDriver(tmp_path, num_slots=1)
    good["model.layers.0.linear_attn.in_proj_qkvz.weight"] = good["model.layers.0.linear_attn.in_proj_qkvz.weight"][:-2]
    save_file(good, str(file), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="in_proj_qkvz.weight has shape"):
        HybridDriver(tmp_path, num_slots=1)


def test_quantized_qwen3_next_projections_are_refused(tmp_path):
    """Qwen3-Next's fused in_proj_qkvz / in_proj_ba rows are reordered at load; a quantized layer in their
    place would take them in the checkpoint's order, so such a checkpoint is refused by name."""
    from torch import nn

    save_tiny_hybrid("qwen3_next", tmp_path)
    model = HybridDriver(tmp_path, num_slots=1).model
    name = "model.layers.0.linear_attn.in_proj_qkvz.weight_scale_inv"
    assert model.remap_checkpoint_name(name) == name  # the plain layer: accepted
    model.model.layers[0].linear_attn.in_proj_qkvz = nn.Identity()  # stands in for a quantized layer
    with pytest.raises(ValueError, match="quantized Qwen3-Next Gated DeltaNet projections"):
        model.remap_checkpoint_name(name)


@pytest.mark.parametrize("arch, config_cls", [
    ("Qwen3NextForCausalLM", "Qwen3NextConfig"), ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig"),
    ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig"), ("Qwen3_5ForConditionalGeneration", "Qwen3_5Config"),
    ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeConfig"),
])
def test_full_size_configs_build_with_transformers_parameter_count(arch, config_cls):
    """transformers' default configs (the released sizes: Qwen3-Next-80B-A3B, Qwen3.5 dense and 35B-A3B), built on
    the meta device: our model holds exactly as many parameters as transformers' text model, and the Gated
    DeltaNet state spec has the released shapes."""
    import transformers

    from tokenfab.models.registry import resolve_model_class

    config = getattr(transformers, config_cls)()
    with torch.device("meta"):
        ours = resolve_model_class(arch)(config, max_position=4096)
        auto = transformers.AutoModelForImageTextToText if "Conditional" in arch else transformers.AutoModelForCausalLM
        hf = auto.from_config(config)
    assert sum(p.numel() for p in ours.parameters()) == sum(
        p.numel() for n, p in hf.named_parameters() if "visual" not in n)
    text = config.get_text_config()
    spec = next(m for m in ours.modules() if isinstance(m, GatedDeltaNet)).recurrent_state_spec()
    conv_dim = 2 * text.linear_num_key_heads * text.linear_key_head_dim + text.linear_num_value_heads * \
        text.linear_value_head_dim
    assert spec["conv_state"][0] == (conv_dim, text.linear_conv_kernel_dim - 1)
    assert spec["ssm_state"] == ((text.linear_num_value_heads, text.linear_key_head_dim, text.linear_value_head_dim),
                                 torch.float32)


def test_forward_compiles_fullgraph(tmp_path):
    """A prefill step (two sequences) then a decode step through ``torch.compile(fullgraph=True)`` (aot_eager:
    the state tensors' in-place updates functionalized): one graph per path, the states carried between the
    compiled steps, logits equal to eager."""
    save_tiny_hybrid("qwen3_5_text", tmp_path)
    logits = {}
    for mode in ("eager", "compiled"):
        driver = HybridDriver(tmp_path, num_slots=2)
        model = driver.model
        if mode == "compiled":
            driver.runner.forward_logits = torch.compile(
                lambda b, m=model: m.compute_logits(m(b)[b.logits_indices]), fullgraph=True, backend="aot_eager")
        a, b = driver.new_seq([5, 6, 7, 8, 9], 0), driver.new_seq([3, 4], 1)
        driver.step([(a, 5), (b, 2)])
        driver.greedy(a), driver.greedy(b)
        driver.step([(a, 1), (b, 1)])
        logits[mode] = torch.stack([a.logits[-1], b.logits[-1]])
    torch.testing.assert_close(logits["compiled"], logits["eager"], atol=1e-4, rtol=1e-4)
