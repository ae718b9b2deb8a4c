"""A toy hybrid model for the hybrid-cache tests: a tiny Llama whose first layer also runs a recurrent
mixer keeping per-sequence state in engine-bound state slots, and a from-scratch reference for it.

The mixer (no weights) reads the normalised input x_t of the layer's attention and adds
    c_t = x_t + 0.5 x_{t-1} + 0.25 x_{t-2}          (a short causal conv; conv_state keeps x_{t-2}, x_{t-1})
    s_t = DECAY * s_{t-1} + c_t                     (a decayed running sum; ssm_state keeps s_{t-1})
    y_t = SCALE * s_t
to the attention output, so every output depends on the whole history through the two states, as a
Gated DeltaNet layer's does. The reference is transformers' Llama on the same checkpoint with a forward
hook that adds the same y computed over the whole sequence from zero, full forward per token (no cache).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

from tests.tiny_models import save_tiny_model, tiny_config
from tokenfab.forward_batch import ForwardBatch
from tokenfab.models.llama import CausalLM, DecoderLayer, LlamaAttention, LlamaForCausalLM, LlamaMLP
from tokenfab.models.registry import register_model

ARCH = "ToyHybridForCausalLM"
DECAY, SCALE = 0.8, 0.5


class DecayedSumMixer(nn.Module):
    """The toy recurrent layer; ``conv_state`` / ``ssm_state`` are bound by the engine's ModelRunner."""

    #: a deliberately broken variant for the negative control: ignores the fresh-start rule
    zero_on_fresh_start = True

    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.hidden = hidden
        self.conv_state: torch.Tensor | None = None  # [slots + 1, H, 2]: x_{t-2}, x_{t-1}
        self.ssm_state: torch.Tensor | None = None  # [slots + 1, H]

    def recurrent_state_spec(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {"conv_state": ((self.hidden, 2), torch.float32), "ssm_state": ((self.hidden,), torch.float32)}

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        assert batch.state_slots is not None and batch.state_slots.dtype == torch.int32
        out = torch.empty_like(x)
        cu = batch.cu_seqlens_q.tolist()
        first_pos = batch.positions[batch.cu_seqlens_q[:-1].long()].tolist()
        for b, slot in enumerate(batch.state_slots.tolist()):
            if first_pos[b] == 0 and self.zero_on_fresh_start:
                conv = x.new_zeros(self.hidden, 2, dtype=torch.float32)
                s = x.new_zeros(self.hidden, dtype=torch.float32)
            else:
                conv, s = self.conv_state[slot].clone(), self.ssm_state[slot].clone()
            for t in range(cu[b], cu[b + 1]):
                xt = x[t].float()
                s = DECAY * s + (xt + 0.5 * conv[:, 1] + 0.25 * conv[:, 0])
                out[t] = (SCALE * s).to(x.dtype)
                conv = torch.stack([conv[:, 1], xt], dim=1)
            self.conv_state[slot] = conv
            self.ssm_state[slot] = s
        return out


class ToyHybridAttention(LlamaAttention):
    """Llama attention plus the recurrent mixer on the same input (a layer with both caches)."""

    def __init__(self, config: Any, layer_idx: int, max_position: int) -> None:
        super().__init__(config, layer_idx, max_position)
        self.mixer = DecayedSumMixer(config.hidden_size)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return super().forward(x, batch) + self.mixer(x, batch)


class ToyHybridForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, max_position: int | None = None) -> None:
        mp = max_position or config.max_position_embeddings
        CausalLM.__init__(self, config, lambda i: DecoderLayer(
            config, (ToyHybridAttention if i == 0 else LlamaAttention)(config, i, mp), LlamaMLP(config)))

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model(batch)  # the layers, never the native whole-step path (it knows no mixer)


register_model(ARCH, __name__, "ToyHybridForCausalLM")


def save_toy_hybrid(path: Path) -> None:
    """A 2-layer random Llama checkpoint (vocab 320) whose config names the toy hybrid architecture."""
    config = tiny_config("llama", num_hidden_layers=2, max_position_embeddings=1024)
    save_tiny_model(config, path)
    cfg = path / "config.json"
    cfg.write_text(cfg.read_text().replace('"LlamaForCausalLM"', f'"{ARCH}"'))


def mixer_reference(xs: torch.Tensor) -> torch.Tensor:
    """y for a whole sequence [T, H] from a zero state, recomputed from scratch."""
    ys = torch.empty_like(xs)
    x1 = x2 = s = torch.zeros(xs.shape[1], dtype=torch.float32)
    for t in range(xs.shape[0]):
        xt = xs[t].float()
        s = DECAY * s + xt + 0.5 * x1 + 0.25 * x2
        ys[t] = (SCALE * s).to(xs.dtype)
        x1, x2 = xt, x1
    return ys


def reference_greedy(path: Path, prompts: list[list[int]], n: int, with_mixer: bool = True) -> list[list[int]]:
    """transformers' greedy tokens for each prompt, full forward per token (no cache, no slots)."""
    import transformers

    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    attn = hf.model.layers[0].self_attn

    def add_mixer(module, args, kwargs, output):
        x = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
        return (output[0] + mixer_reference(x[0])[None],) + tuple(output[1:])

    if with_mixer:
        attn.register_forward_hook(add_mixer, with_kwargs=True)
    results = []
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: one thread is ~10x faster on a shared 2-core machine
    try:
        with torch.no_grad():
            for p in prompts:
                ids = list(p)
                for _ in range(n):
                    logits = hf(torch.tensor([ids]), use_cache=False, logits_to_keep=1).logits
                    ids.append(int(logits[0, -1].argmax()))
                results.append(ids[len(p):])
    finally:
        torch.set_num_threads(threads)
    return results
