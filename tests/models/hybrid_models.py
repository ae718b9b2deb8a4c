"""Tiny random-weight Qwen3-Next / Qwen3.5 checkpoints in their official layouts, and a small driver that runs
our model on hand-built flat batches with its recurrent state slots bound by the model runner, for comparing
against transformers.

Layouts written (``save_tiny_hybrid``): ``save_pretrained`` of the transformers model (per-expert MoE tensors
for the text classes; the VL wrappers with ``text_config``, ``model.language_model.*`` and a vision tower),
and for Qwen3.5-MoE's wrapper the released form with stacked experts (``mlp.experts.gate_up_proj``
[E, 2I, H], ``mlp.experts.down_proj`` [E, H, I]) and an ``mtp.*`` layer beside the text model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.tiny_models import randomize_

HYBRID_COMMON = dict(
    vocab_size=320, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
    max_position_embeddings=512, rms_norm_eps=1e-6, tie_word_embeddings=False,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, num_hidden_layers=4,  # linear, linear, linear, full (the released pattern)
)
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
# Qwen3.5's text configs name M-RoPE (text positions make it plain RoPE); rotary dim 32 * 0.25 = 8 = 2 x (2+1+1)
MROPE = dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25,
                                  mrope_section=[2, 1, 1], mrope_interleaved=True))
VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)

FAMILIES = {
    # layer 1 dense (mlp_only_layers), the others MoE with the gated shared expert
    "qwen3_next": ("Qwen3NextConfig", dict(**MOE, intermediate_size=96, mlp_only_layers=[1])),
    "qwen3_5_text": ("Qwen3_5TextConfig", dict(intermediate_size=96, **MROPE)),
    "qwen3_5_moe_text": ("Qwen3_5MoeTextConfig", dict(**MOE, **MROPE)),
    "qwen3_5": ("Qwen3_5Config", dict(intermediate_size=96, **MROPE)),  # VL wrapper, dense
    "qwen3_5_moe": ("Qwen3_5MoeConfig", dict(**MOE, **MROPE)),  # VL wrapper, MoE (released layout)
}
WRAPPERS = ("qwen3_5", "qwen3_5_moe")


def tiny_hybrid_config(family: str, **overrides: Any):
    import transformers

    cls_name, extra = FAMILIES[family]
    text = {**HYBRID_COMMON, **extra, **overrides}
    cls = getattr(transformers, cls_name)
    if family in WRAPPERS:
        return cls(text_config=text, vision_config=VISION, tie_word_embeddings=text["tie_word_embeddings"])
    return cls(**text)


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert ``...mlp.experts.{e}.{gate,up,down}_proj.weight`` -> the stacked tensors of the release."""
    out: dict[str, torch.Tensor] = {}
    experts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for name, t in tensors.items():
        if ".mlp.experts." in name:
            prefix, rest = name.split(".mlp.experts.")
            e, proj, _ = rest.split(".")
            experts.setdefault(prefix, {}).setdefault(int(e), {})[proj] = t
        else:
            out[name] = t
    for prefix, by_e in experts.items():
        es = [by_e[e] for e in sorted(by_e)]
        out[f"{prefix}.mlp.experts.gate_up_proj"] = torch.stack([torch.cat((p["gate_proj"], p["up_proj"])) for p in es])
        out[f"{prefix}.mlp.experts.down_proj"] = torch.stack([p["down_proj"] for p in es])
    return out


def save_tiny_hybrid(family: str, path: Path, seed: int = 0, mtp_placeholder: bool = True, **overrides: Any) -> Any:
    """Build the transformers model (random fp32 weights), save it in the family's official layout, return it.
    ``mtp_placeholder``: Qwen3.5-MoE's released layout gets two ``mtp.*`` tensors (kept aside at load, unused
    without MTP speculation); a full MTP layer comes from ``tests/models/hybrid_mtp.py`` instead."""
    import transformers
    from safetensors.torch import load_file, save_file

    config = tiny_hybrid_config(family, **overrides)
    torch.manual_seed(seed)
    auto = transformers.AutoModelForImageTextToText if family in WRAPPERS else transformers.AutoModelForCausalLM
    model = randomize_(auto.from_config(config, dtype=torch.float32))
    model.save_pretrained(path, safe_serialization=True)
    if family == "qwen3_5_moe":  # the released layout: stacked experts, an MTP layer aside
        file = Path(path) / "model.safetensors"
        tensors = _stack_experts(load_file(str(file)))
        if mtp_placeholder:
            tensors["mtp.fc.weight"] = torch.randn(64, 128)
            tensors["mtp.layers.0.input_layernorm.weight"] = torch.randn(64)
        save_file(tensors, str(file), metadata={"format": "pt"})
    return model


def config_json(path: Path) -> dict:
    return json.loads((Path(path) / "config.json").read_text())


@dataclass
class Seq:
    """One sequence of the driver: its tokens so far, how many the model has seen, its state slot."""

    tokens: list[int]
    slot: int
    blocks: list[int]
    computed: int = 0
    logits: list[torch.Tensor] = field(default_factory=list)


class HybridDriver:
    """Our model (``load_model``) behind a ModelRunner (paged KV cache for the attention layers, state slots for
    the Gated DeltaNet layers), stepping hand-built ForwardBatches: chunks of any length per sequence, mixed
    in one step, each sequence on the state slot the test gives it (so tests choose when slots are reused)."""

    BLOCK = 4
    BLOCKS_PER_SEQ = 32

    def __init__(self, path: Path, num_slots: int = 6) -> None:
        from tokenfab.engine.runner.model_runner import ModelRunner
        from tokenfab.loader.model_loader import load_model

        self.model = load_model(path, torch.float32, torch.device("cpu"), load_tokenizer=False).model
        # the runner binds each Gated DeltaNet layer's state tensors ([num_slots + 1 scratch, *spec], zeros)
        self.runner = ModelRunner(self.model, torch.device("cpu"), torch.float32, self.BLOCK,
                                  self.BLOCKS_PER_SEQ * num_slots, num_state_slots=num_slots)
        self.num_slots = num_slots

    def new_seq(self, prompt: list[int], slot: int) -> Seq:
        blocks = list(range(slot * self.BLOCKS_PER_SEQ, (slot + 1) * self.BLOCKS_PER_SEQ))
        return Seq(list(prompt), slot, blocks)

    def step(self, work: list[tuple[Seq, int]]) -> None:
        """One forward over ``n`` new tokens of each (seq, n); each seq's last-row logits appended to it."""
        from tokenfab.forward_batch import ForwardBatch

        ids, pos, slots_map, cu, ctx = [], [], [], [0], []
        for seq, n in work:
            start = seq.computed
            assert start + n <= len(seq.tokens)
            ids += seq.tokens[start:start + n]
            for p in range(start, start + n):
                pos.append(p)
                slots_map.append(seq.blocks[p // self.BLOCK] * self.BLOCK + p % self.BLOCK)
            cu.append(cu[-1] + n)
            ctx.append(start + n)
        batch = ForwardBatch(
            input_ids=torch.tensor(ids), positions=torch.tensor(pos), slot_mapping=torch.tensor(slots_map),
            block_tables=torch.tensor([s.blocks for s, _ in work], dtype=torch.int32),
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), context_lens=torch.tensor(ctx, dtype=torch.int32),
            logits_indices=torch.tensor(cu[1:]) - 1, max_query_len=max(n for _, n in work),
            max_context_len=max(ctx), state_slots=torch.tensor([s.slot for s, _ in work], dtype=torch.int32),
        )
        logits = self.runner.execute(batch)
        for row, (seq, n) in enumerate(work):
            seq.computed += n
            seq.logits.append(logits[row])

    def greedy(self, seq: Seq) -> int:
        """Append the argmax of the seq's last logits as its next token."""
        tok = int(seq.logits[-1].argmax())
        seq.tokens.append(tok)
        return tok
