"""The C-driven step of a packed-GGUF Llama on CPU (``kernels/cpu/llama_step.c``).

A decode step of the bundled model is ~300 kernel calls; from Python they cost about as much as the
kernels themselves. When the whole model is made of what the C driver runs -- a Llama/Mistral/Qwen2/
Qwen3 decoder at TP 1 whose linear layers and embedding hold packed GGML weights, over a
float32 KV cache without sinks or softcap -- :class:`NativeLlamaStep` describes it once in two int64
tables and runs each step in one call. The result is the Python layers' bit for bit (same kernels,
same order; ``tests/models/test_llama_native_step.py``).

Each step first re-checks what can change under a built table: the environment (``TOKENFAB_KERNELS``
not auto, ``TOKENFAB_CPU_NATIVE=0`` or ``TOKENFAB_NATIVE_STEP=0`` send the step back to the Python
layers), a swapped matmul (tests), and the identity of every tensor the tables point to (a rebound
KV cache or reloaded weights rebuild them).
"""

from __future__ import annotations

import logging
import operator
from typing import Any

import torch
from torch import nn

from tokenfab.forward_batch import ForwardBatch
from tokenfab.kernels._dispatch import kernel_mode
from tokenfab.kernels.cpu import enabled as native_enabled
from tokenfab.kernels.cpu import getenv, native_library
from tokenfab.kernels.cpu.llama_step import CFG_FIELDS, LAYER_FIELDS, llama_step, pack_table
from tokenfab.layers import ggml_linear
from tokenfab.layers.ggml_linear import GGMLEmbedding, GGMLLinear

log = logging.getLogger(__name__)
ENV = "TOKENFAB_NATIVE_STEP"
_OFF = ("0", "false", "no", "off")


def _linear_row(prefix: str, lin: Any, k: int) -> dict[str, int] | str:
    """A linear layer's table entries, or why the driver cannot run it."""
    if type(lin) is not GGMLLinear or lin._fn is None:
        return f"{prefix} is {type(lin).__name__}, not a native packed GGML layer"
    if lin.tp_split is not None or lin.reduce_output:
        return f"{prefix} is tensor-parallel"
    if lin.in_features != k:
        return f"{prefix} takes {lin.in_features} features, the driver feeds it {k}"
    row = {f"{prefix}.weight": lin.qweight.data_ptr(), f"{prefix}.qtype": lin._qid,
           f"{prefix}.act_q8": int(lin.act == "q8"), f"{prefix}.rows": lin.out_features}
    row16 = lin.row16_weight()
    if row16 is not None:
        row[f"{prefix}.row16"] = row16.data_ptr()
    b = lin.bias
    if b is not None:
        if b.dtype != torch.float32 or not b.is_contiguous() or b.shape != (lin.out_features,):
            return f"{prefix} has a bias the driver cannot add ({b.dtype}, {tuple(b.shape)})"
        row[f"{prefix}.bias"] = b.data_ptr()
    return row


def _f32_vector(t: Any, n: int) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.is_contiguous() and t.shape == (n,) \
        and t.device.type == "cpu"


class NativeLlamaStep:
    """The tables of one model as bound now; ``why_not`` says why the model cannot run natively."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.why_not = self._build(model)  # first: it builds the layers' row16 copies the tables point to
        # every tensor the tables point to (and the layers' other tensors), column-wise for
        # current(): the tables are current while the model holds these very objects
        watched = self._tensors_of(model)
        self._slots, self._names, self._objects = ([e[i] for e in watched] for i in range(3))

    def _build(self, model: nn.Module) -> str | None:
        cfg_model = model.model
        emb = cfg_model.embed_tokens
        if type(emb) is not GGMLEmbedding or emb.tp_split is not None:
            return "the embedding is not a packed GGML embedding at TP 1"
        h = emb.hidden_size
        if not _f32_vector(cfg_model.norm.weight, h):
            return "the final norm weight is not float32 [hidden]"
        rows, attn0, inter = [], None, None
        for i, layer in enumerate(cfg_model.layers):
            a, mlp = layer.self_attn, layer.mlp
            attn, rope = a.attn, a.rotary_emb
            if attn.sinks is not None or attn.softcap or attn.k_scale is not None:
                return f"layer {i}: sinks, softcap or an fp8 cache"
            kc, vc = attn.k_cache, attn.v_cache
            if kc is None or kc.dtype != torch.float32 or not kc.is_contiguous() or not vc.is_contiguous():
                return f"layer {i}: the KV cache is not bound, or not contiguous float32"
            cs = rope.cos_sin_cache
            if cs.dtype != torch.float32 or not cs.is_contiguous() or not rope.is_neox:
                return f"layer {i}: the rotary cache is not a contiguous float32 NeoX cache"
            shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim, rope.rotary_dim, tuple(kc.shape), a.qk_norm)
            if attn0 is None:
                attn0 = shape
            elif shape != attn0:
                return f"layer {i}: attention shapes differ from layer 0's"
            norms = (layer.input_layernorm, layer.post_attention_layernorm)
            if not all(_f32_vector(n.weight, h) for n in norms):
                return f"layer {i}: a norm weight is not float32 [hidden]"
            if any(n.eps != cfg_model.norm.eps for n in norms):
                return f"layer {i}: norms with different eps"
            inter = mlp.down_proj.in_features
            qk = {}
            if a.qk_norm:  # Qwen3: per-head RMSNorm of q and k, with the model's eps
                heads = (a.q_norm, a.k_norm)
                if not all(_f32_vector(n.weight, attn.head_dim) for n in heads) or any(
                        n.eps != cfg_model.norm.eps for n in heads):
                    return f"layer {i}: q/k norm weights that are not float32 [head_dim] or another eps"
                qk = {"q_norm": a.q_norm.weight.data_ptr(), "k_norm": a.k_norm.weight.data_ptr()}
            row = {**qk, "input_norm": layer.input_layernorm.weight.data_ptr(),
                   "post_norm": layer.post_attention_layernorm.weight.data_ptr(),
                   "k_cache": kc.data_ptr(), "v_cache": vc.data_ptr(), "cos_sin": cs.data_ptr(),
                   "window": attn.sliding_window}
            hq_d = attn.num_heads * attn.head_dim
            for prefix, lin, k in (("qkv", a.qkv_proj, h), ("o", a.o_proj, hq_d), ("gate_up", mlp.gate_up_proj, h),
                                   ("down", mlp.down_proj, inter)):
                entry = _linear_row(prefix, lin, k)
                if isinstance(entry, str):
                    return f"layer {i}: {entry}"
                row.update(entry)
            if a.qkv_proj.out_features != (attn.num_heads + 2 * attn.num_kv_heads) * attn.head_dim \
                    or mlp.gate_up_proj.out_features != 2 * inter or a.o_proj.out_features != h \
                    or mlp.down_proj.out_features != h:
                return f"layer {i}: projection sizes do not fit the heads"
            rows.append(row)
        if attn0 is None:
            return "no layers"
        hq, hkv, d, rot, cache_shape, qk_norm = attn0
        self.scale = float(cfg_model.layers[0].self_attn.attn.scale)
        self.eps = float(cfg_model.norm.eps)
        cfg = {"layers": len(rows), "hidden": h, "heads": hq, "kv_heads": hkv, "head_dim": d, "intermediate": inter,
               "embed": emb.qweight.data_ptr(), "embed_qtype": ggml_linear._QTYPE_ID[emb.qtype],
               "final_norm": cfg_model.norm.weight.data_ptr(), "rotary_dim": rot, "neox": 1,
               "block_size": cache_shape[1], "qk_norm": int(qk_norm)}
        self.cfg = pack_table([cfg], CFG_FIELDS)[0]
        self.layers = pack_table(rows, LAYER_FIELDS)
        n_pos = min(int(layer.self_attn.rotary_emb.cos_sin_cache.shape[0]) for layer in cfg_model.layers)
        self.limits = (emb.num_embeddings, n_pos, cache_shape[0], cache_shape[0] * cache_shape[1])
        return None

    def current(self) -> bool:
        """Whether every tensor the tables point to is still the model's (same objects): one dict
        lookup per tensor, where walking the modules' attributes cost ~0.3 ms a step. The lookups run
        as maps in C: over the ~450 entries of the bundled model 0.15 ms a step, where a generator
        over them (and the row16 copies, now left to their qweight) took 0.29 ms."""
        return all(map(operator.is_, map(dict.get, self._slots, self._names), self._objects))

    @staticmethod
    def _tensors_of(model: nn.Module) -> list[tuple[dict, str, Any]]:
        """(the dict that holds it, its name, the tensor) of every tensor the tables may point to."""
        m = model.model
        out: list[tuple[dict, str, Any]] = []

        def watch(module: Any, name: str) -> None:
            if module is None:
                out.append(({}, name, None))
                return
            for slots in (module._parameters, module._buffers, module.__dict__):
                if name in slots:
                    out.append((slots, name, slots[name]))
                    return
            out.append((module.__dict__, name, None))

        watch(m.embed_tokens, "qweight")
        watch(m.norm, "weight")
        for layer in m.layers:
            a, mlp = layer.self_attn, layer.mlp
            watch(layer.input_layernorm, "weight")
            watch(layer.post_attention_layernorm, "weight")
            watch(a.attn, "k_cache")
            watch(a.attn, "v_cache")
            watch(a.rotary_emb, "cos_sin_cache")
            watch(getattr(a, "q_norm", None), "weight")
            watch(getattr(a, "k_norm", None), "weight")
            for lin in (a.qkv_proj, a.o_proj, getattr(mlp, "gate_up_proj", None), getattr(mlp, "down_proj", None)):
                watch(lin, "qweight")  # (its row16 copy follows it: GGMLLinear.row16_weight)
                watch(lin, "bias")
        return out

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return llama_step(self.cfg, self.layers, self.eps, self.scale, batch.input_ids, batch.positions,
                          batch.slot_mapping, batch.block_tables, batch.cu_seqlens_q, batch.context_lens,
                          batch.max_query_len, self.limits)


def usable_now() -> bool:
    """The environment lets the native step run (read every step: tests change it)."""
    return (getenv(ENV, "1").lower() not in _OFF and native_enabled() and kernel_mode() == "auto"
            and ggml_linear.ggml_matmul is ggml_linear._CHECKED_MATMUL and native_library() is not None)


def native_hidden(model: nn.Module, batch: ForwardBatch) -> torch.Tensor | None:
    """The step's hidden states through the C driver, or None where the Python layers must run it."""
    if batch.input_ids.device.type != "cpu" or not usable_now():
        return None
    step: NativeLlamaStep | None = getattr(model, "_native_step", None)
    if step is None or not step.current():
        step = NativeLlamaStep(model)
        if step.why_not and getattr(model, "_native_step", None) is None:
            log.info("the C-driven step does not run this model: %s", step.why_not)
        model._native_step = step
    if step.why_not:
        return None
    return step.forward(batch)
