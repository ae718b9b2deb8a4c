"""Tiny GGUF files written with gguf.GGUFWriter the way llama.cpp's converter lays them out, plus an
independent, block-by-block reference decoder for the basic ggml formats.

`tiny_model(...)` draws a random model in Hugging Face layout; `write_tiny_gguf(...)` stores it as a
GGUF file (llama.cpp names, q/k rows permuted for the llama architecture, 2-D weights in the chosen
ggml types, 1-D tensors in F32) and returns what a correct loader must give back for each HF name.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np
from gguf import GGMLQuantizationType as QT

# --------------------------------------------------------------------------------------------
# Reference decoder: one block at a time, straight from the ggml block layouts, with `struct`.
# --------------------------------------------------------------------------------------------

REFERENCE_TYPES = (QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1)


def _f32(x: float) -> np.float32:
    return np.float32(x)


def reference_dequantize(raw: bytes, qtype: QT, n_values: int) -> np.ndarray:
    """Decode `n_values` values of type `qtype` from `raw` without numpy vectorization."""
    out = np.empty(n_values, dtype=np.float32)
    if qtype == QT.F32:
        out[:] = struct.unpack(f"<{n_values}f", raw[: 4 * n_values])
    elif qtype == QT.F16:
        out[:] = struct.unpack(f"<{n_values}e", raw[: 2 * n_values])
    elif qtype == QT.BF16:
        for i, (h,) in enumerate(struct.iter_unpack("<H", raw[: 2 * n_values])):
            out[i] = struct.unpack("<f", struct.pack("<I", h << 16))[0]
    elif qtype == QT.Q8_0:  # f16 d | 32 x int8 q ; x = q * d
        for b in range(n_values // 32):
            d = _f32(struct.unpack_from("<e", raw, 34 * b)[0])
            qs = struct.unpack_from("<32b", raw, 34 * b + 2)
            for j, q in enumerate(qs):
                out[32 * b + j] = _f32(q) * d
    elif qtype == QT.Q4_0:  # f16 d | 16 bytes: x[j] = (lo(j) - 8) * d, x[j + 16] = (hi(j) - 8) * d
        for b in range(n_values // 32):
            d = _f32(struct.unpack_from("<e", raw, 18 * b)[0])
            for j, byte in enumerate(raw[18 * b + 2 : 18 * b + 18]):
                out[32 * b + j] = _f32((byte & 0xF) - 8) * d
                out[32 * b + j + 16] = _f32((byte >> 4) - 8) * d
    elif qtype == QT.Q4_1:  # f16 d | f16 m | 16 bytes: x[j] = lo(j) * d + m, x[j + 16] = hi(j) * d + m
        for b in range(n_values // 32):
            d = _f32(struct.unpack_from("<e", raw, 20 * b)[0])
            m = _f32(struct.unpack_from("<e", raw, 20 * b + 2)[0])
            for j, byte in enumerate(raw[20 * b + 4 : 20 * b + 20]):
                out[32 * b + j] = _f32(byte & 0xF) * d + m
                out[32 * b + j + 16] = _f32(byte >> 4) * d + m
    else:
        raise NotImplementedError(qtype)
    return out


def encode(values: np.ndarray, qtype: QT) -> np.ndarray:
    """Values (rows along the last axis) -> the array GGUFWriter stores for type `qtype`."""
    values = np.ascontiguousarray(values, dtype=np.float32)
    if qtype == QT.F32:
        return values
    if qtype == QT.F16:
        return values.astype(np.float16)
    return gguf.quants.quantize(values, qtype)


# --------------------------------------------------------------------------------------------
# Tiny models
# --------------------------------------------------------------------------------------------

GLOBAL_TO_GGUF = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
LAYER_TO_GGUF = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.bias": "attn_output.bias",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(hf_name: str) -> str:
    if hf_name in GLOBAL_TO_GGUF:
        return GLOBAL_TO_GGUF[hf_name]
    _, _, layer, rest = hf_name.split(".", 3)
    return f"blk.{layer}.{LAYER_TO_GGUF[rest]}"


def llama_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """What convert_hf_to_gguf.py does to Llama q/k rows: within each head, interleave the rows of
    the first and second rotary half (HF row (h, i, j) -> GGUF row (h, j, i))."""
    rows = w.shape[0]
    return np.ascontiguousarray(w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2)).reshape(
        w.shape
    )


@dataclass
class TinySpec:
    arch: str = "llama"
    n_layers: int = 2
    hidden: int = 64
    inter: int = 128
    n_head: int = 4
    n_kv: int = 2
    head_dim: int = 16
    vocab: int = 96
    context: int = 512
    eps: float = 1e-6
    theta: float = 10000.0
    tied: bool = True
    attention_bias: bool = False
    write_key_length: bool = False
    # ggml type per 2-D weight; keys are HF name suffixes ("q_proj.weight", "embed_tokens.weight", ...)
    types: dict[str, QT] = field(default_factory=dict)
    default_type: QT = QT.F32


def tiny_model(spec: TinySpec, seed: int = 0) -> dict[str, np.ndarray]:
    """Random float32 weights in Hugging Face layout for `spec`."""
    rng = np.random.default_rng(seed)
    h, hd = spec.hidden, spec.head_dim
    q, kv = spec.n_head * hd, spec.n_kv * hd

    def mat(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    w: dict[str, np.ndarray] = {"model.embed_tokens.weight": mat(spec.vocab, h)}
    for i in range(spec.n_layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = 1 + mat(h)
        w[p + "self_attn.q_proj.weight"] = mat(q, h)
        w[p + "self_attn.k_proj.weight"] = mat(kv, h)
        w[p + "self_attn.v_proj.weight"] = mat(kv, h)
        w[p + "self_attn.o_proj.weight"] = mat(h, q)
        if spec.arch == "qwen2" or spec.attention_bias:
            w[p + "self_attn.q_proj.bias"] = mat(q)
            w[p + "self_attn.k_proj.bias"] = mat(kv)
            w[p + "self_attn.v_proj.bias"] = mat(kv)
        if spec.arch != "qwen2" and spec.attention_bias:
            w[p + "self_attn.o_proj.bias"] = mat(h)
        if spec.arch == "qwen3":
            w[p + "self_attn.q_norm.weight"] = 1 + mat(hd)
            w[p + "self_attn.k_norm.weight"] = 1 + mat(hd)
        w[p + "post_attention_layernorm.weight"] = 1 + mat(h)
        w[p + "mlp.gate_proj.weight"] = mat(spec.inter, h)
        w[p + "mlp.up_proj.weight"] = mat(spec.inter, h)
        w[p + "mlp.down_proj.weight"] = mat(h, spec.inter)
    w["model.norm.weight"] = 1 + mat(h)
    if not spec.tied:
        w["lm_head.weight"] = mat(spec.vocab, h)
    return w


def type_of(spec: TinySpec, hf_name: str, value: np.ndarray) -> QT:
    if value.ndim == 1:
        return QT.F32  # llama.cpp keeps norms and biases in F32
    for suffix, qtype in spec.types.items():
        if hf_name.endswith(suffix):
            return qtype
    return spec.default_type


def gpt2_alphabet() -> list[str]:
    """GPT-2's byte-level alphabet: byte b is spelled by this character (printable bytes as
    themselves, the rest shifted past U+0100 in order)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    chars, shifted = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b] = chr(0x100 + shifted)
            shifted += 1
    return [chars[b] for b in range(256)]


TINY_MERGES = ["h e", "l l", "he ll", "Ġ w", "o r"]
TINY_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_vocab() -> tuple[list[str], list[int]]:
    """Byte-level BPE vocabulary: 256 byte tokens, the merge results, then control tokens."""
    tokens = gpt2_alphabet() + ["he", "ll", "hell", "Ġw", "or"] + TINY_SPECIALS
    types = [1] * (len(tokens) - len(TINY_SPECIALS)) + [3] * len(TINY_SPECIALS)  # 1 normal, 3 control
    return tokens, types


def write_tiny_gguf(
    path: Path,
    spec: TinySpec,
    weights: dict[str, np.ndarray] | None = None,
    *,
    tokenizer: bool = False,
    drop: tuple[str, ...] = (),
    extra_tensors: dict[str, tuple[np.ndarray, QT | None]] | None = None,
    skip_metadata: tuple[str, ...] = (),
    metadata: dict[str, Any] | None = None,
) -> dict[str, np.ndarray]:
    """Write `spec` (or `weights`) to `path` as llama.cpp would; return the expected HF tensors.

    `drop` leaves out GGUF tensors by name; `extra_tensors` adds raw ones (array, raw ggml type);
    `skip_metadata` leaves out keys; `metadata` adds `{key: value}` (str, float, int or bool).
    """
    weights = tiny_model(spec) if weights is None else weights
    arch = spec.arch
    w = gguf.GGUFWriter(str(path), arch)
    kv = {
        f"{arch}.block_count": lambda: w.add_block_count(spec.n_layers),
        f"{arch}.context_length": lambda: w.add_context_length(spec.context),
        f"{arch}.embedding_length": lambda: w.add_embedding_length(spec.hidden),
        f"{arch}.feed_forward_length": lambda: w.add_feed_forward_length(spec.inter),
        f"{arch}.attention.head_count": lambda: w.add_head_count(spec.n_head),
        f"{arch}.attention.head_count_kv": lambda: w.add_head_count_kv(spec.n_kv),
        f"{arch}.attention.layer_norm_rms_epsilon": lambda: w.add_layer_norm_rms_eps(spec.eps),
        f"{arch}.rope.freq_base": lambda: w.add_rope_freq_base(spec.theta),
    }
    if arch == "llama":
        kv[f"{arch}.rope.dimension_count"] = lambda: w.add_rope_dimension_count(spec.head_dim)
    if spec.write_key_length:
        kv[f"{arch}.attention.key_length"] = lambda: w.add_key_length(spec.head_dim)
        kv[f"{arch}.attention.value_length"] = lambda: w.add_value_length(spec.head_dim)
    for key, add in kv.items():
        if key not in skip_metadata:
            add()
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            w.add_string(key, value)
        elif isinstance(value, bool):
            w.add_bool(key, value)
        elif isinstance(value, int):
            w.add_uint32(key, value)
        else:
            w.add_float32(key, float(value))
    if tokenizer:
        tokens, types = tiny_vocab()
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("qwen2")
        w.add_token_list(tokens)
        w.add_token_types(types)
        w.add_token_merges(TINY_MERGES)
        w.add_bos_token_id(tokens.index("<|endoftext|>"))
        w.add_eos_token_id(tokens.index("<|im_end|>"))
        w.add_pad_token_id(tokens.index("<|endoftext|>"))
        w.add_chat_template(TINY_TEMPLATE)

    expected: dict[str, np.ndarray] = {}
    for hf_name, value in weights.items():
        name = gguf_name(hf_name)
        if name in drop:
            continue
        qtype = type_of(spec, hf_name, value)
        stored = encode(value, qtype)
        # Decoding is row-wise and the permutation moves whole rows, so the expected HF tensor is
        # the reference decoding of the unpermuted weight (or gguf's own, for the other types).
        if qtype in REFERENCE_TYPES:
            exp = reference_dequantize(stored.tobytes(), qtype, value.size).reshape(value.shape)
        else:
            exp = gguf.quants.dequantize(stored, qtype).reshape(value.shape)
        expected[hf_name] = exp
        if arch == "llama" and name.endswith(("attn_q.weight", "attn_q.bias")):
            stored = llama_permute(stored, spec.n_head)
        elif arch == "llama" and name.endswith(("attn_k.weight", "attn_k.bias")):
            stored = llama_permute(stored, spec.n_kv)
        raw_dtype = None if qtype in (QT.F32, QT.F16) else qtype
        w.add_tensor(name, stored, raw_dtype=raw_dtype)
    for name, (array, raw_dtype) in (extra_tensors or {}).items():
        w.add_tensor(name, array, raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def tensor_type_offset(path: Path, tensor_name: str) -> int:
    """Byte offset of the ggml type field in `tensor_name`'s tensor-info record."""
    data = path.read_bytes()
    encoded = tensor_name.encode()
    at = data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)
    (n_dims,) = struct.unpack_from("<I", data, at)
    return at + 4 + 8 * n_dims
