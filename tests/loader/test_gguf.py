"""tokenfab.loader.gguf: dequantization, configs and tensors of GGUF files, tokenizer, errors, and the
bundled SmolLM2 file against transformers' own GGUF loading."""

from __future__ import annotations

import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT

from tests.loader.tiny_gguf import (
    REFERENCE_TYPES,
    TINY_TEMPLATE,
    TinySpec,
    encode,
    reference_dequantize,
    tensor_type_offset,
    tiny_vocab,
    write_tiny_gguf,
)
from tokenfab.loader.bundled import bundled_model_path
from tokenfab.loader.errors import ModelLoadError
from tokenfab.loader.gguf import dequantize, load_gguf, load_gguf_tokenizer, supports_ggml_type

# --------------------------------------------------------------------------------------------
# Dequantization
# --------------------------------------------------------------------------------------------


def _random_blocks(qtype: QT, n_blocks: int, rng: np.random.Generator) -> np.ndarray:
    """Random block bytes with finite f16 scales: decodes values `quantize` would never produce."""
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    n_scales = {QT.Q8_0: 1, QT.Q4_0: 1, QT.Q4_1: 2}[qtype]
    scales = (rng.standard_normal((n_blocks, n_scales)) * 0.05).astype(np.float16)
    scales[0] = 0  # an all-zero scale block
    raw[:, : 2 * n_scales] = scales.view(np.uint8)
    return raw


@pytest.mark.parametrize("qtype", REFERENCE_TYPES, ids=lambda t: t.name)
def test_dequantize_matches_reference(qtype: QT) -> None:
    rng = np.random.default_rng(int(qtype))
    values = (rng.standard_normal((6, 64)) * 3).astype(np.float32)
    values[0, :32] = 0.0  # a block of zeros
    values[1, :32] = 7.5  # a constant block
    values[2, 5] = -1e4  # an outlier
    stored = encode(values, qtype)
    ours = dequantize(stored, qtype, values.shape)
    ref = reference_dequantize(stored.tobytes(), qtype, values.size).reshape(values.shape)
    assert ours.dtype == np.float32 and ours.shape == values.shape
    np.testing.assert_array_equal(ours, ref)
    # and bit-identical with gguf's own decoder, which transformers uses
    theirs = gguf.quants.dequantize(stored, qtype).reshape(values.shape)
    np.testing.assert_array_equal(ours, theirs)
    if qtype in (QT.F32, QT.BF16, QT.F16):
        tol = {QT.F32: 0, QT.F16: 1e-3, QT.BF16: 1e-2}[qtype]
        np.testing.assert_allclose(ours, values, rtol=tol, atol=0)

    if qtype in (QT.Q8_0, QT.Q4_0, QT.Q4_1):
        raw = _random_blocks(qtype, 40, rng)
        ours = dequantize(raw, qtype, (4, 320))
        ref = reference_dequantize(raw.tobytes(), qtype, 4 * 320).reshape(4, 320)
        np.testing.assert_array_equal(ours, ref)


def test_dequantize_chunks_large_tensors(monkeypatch: pytest.MonkeyPatch) -> None:
    import tokenfab.loader.gguf_quants as mod

    rng = np.random.default_rng(1)
    raw = _random_blocks(QT.Q4_1, 50, rng)
    whole = dequantize(raw, QT.Q4_1, (10, 160))
    monkeypatch.setattr(mod, "_CHUNK_ELEMENTS", 96)  # three blocks per chunk, ragged last chunk
    np.testing.assert_array_equal(dequantize(raw, QT.Q4_1, (10, 160)), whole)


@pytest.mark.parametrize("qtype", [QT.Q5_0, QT.Q5_1, QT.Q4_K, QT.Q6_K, QT.IQ4_NL], ids=lambda t: t.name)
def test_other_types_pass_through_to_gguf(qtype: QT) -> None:
    rng = np.random.default_rng(int(qtype))
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    cols = 2 * max(block_size, 32)
    try:
        stored = gguf.quants.quantize(rng.standard_normal((3, cols)).astype(np.float32), qtype)
    except NotImplementedError:  # no quantizer in gguf-py: decode whatever the bytes say
        stored = rng.integers(0, 256, size=(3, cols // block_size * type_size), dtype=np.uint8)
    assert supports_ggml_type(qtype)
    np.testing.assert_array_equal(
        dequantize(stored, qtype, (3, cols)), gguf.quants.dequantize(stored, qtype).reshape(3, cols)
    )


def test_unsupported_types_are_reported() -> None:
    for qtype in (QT.I8, QT.I32, QT.Q8_1, QT.Q8_K):
        assert not supports_ggml_type(qtype)
    for qtype in (*REFERENCE_TYPES, QT.F64):
        assert supports_ggml_type(qtype)


# --------------------------------------------------------------------------------------------
# Tiny files: config and tensors for each architecture
# --------------------------------------------------------------------------------------------


def _check_tensors(path: Path, expected: dict[str, np.ndarray]) -> None:
    ckpt = load_gguf(path)
    got = dict(ckpt.tensors())
    assert sorted(got) == sorted(expected)
    assert ckpt.tensor_names() == list(got)
    for name, tensor in got.items():
        assert tensor.dtype == torch.float32, name
        np.testing.assert_array_equal(tensor.numpy(), expected[name], err_msg=name)


def _check_config(ckpt, spec: TinySpec) -> None:
    c = ckpt.config
    assert c.model_type == spec.arch
    assert c.vocab_size == spec.vocab
    assert c.hidden_size == spec.hidden
    assert c.intermediate_size == spec.inter
    assert c.num_hidden_layers == spec.n_layers
    assert c.num_attention_heads == spec.n_head
    assert c.num_key_value_heads == spec.n_kv
    assert c.head_dim == spec.head_dim
    assert c.max_position_embeddings == spec.context
    assert c.rms_norm_eps == pytest.approx(spec.eps, rel=1e-6)
    assert c.rope_parameters["rope_theta"] == pytest.approx(spec.theta)
    assert c.tie_word_embeddings == spec.tied
    assert c.architectures == [ckpt.architecture]


def test_llama_quantized_roundtrip(tmp_path: Path) -> None:
    spec = TinySpec(
        arch="llama",
        n_head=4,
        n_kv=2,
        types={"embed_tokens.weight": QT.Q8_0, "q_proj.weight": QT.Q4_0, "k_proj.weight": QT.Q4_1,
               "mlp.down_proj.weight": QT.BF16, "o_proj.weight": QT.F16},
        default_type=QT.Q4_1,
        theta=500000.0,
    )
    path = tmp_path / "llama.gguf"
    expected = write_tiny_gguf(path, spec, tokenizer=True)
    ckpt = load_gguf(path)
    assert ckpt.architecture == "LlamaForCausalLM"
    assert type(ckpt.config).__name__ == "LlamaConfig"
    _check_config(ckpt, spec)
    assert ckpt.config.attention_bias is False and ckpt.config.mlp_bias is False
    tokens, _ = tiny_vocab()
    assert ckpt.config.bos_token_id == tokens.index("<|endoftext|>")
    assert ckpt.config.eos_token_id == tokens.index("<|im_end|>")
    assert ckpt.ggml_types()["model.layers.0.self_attn.q_proj.weight"] == "Q4_0"
    assert "lm_head.weight" not in ckpt.tensor_names()
    _check_tensors(path, expected)


def test_llama_untied_with_biases_and_mha(tmp_path: Path) -> None:
    # n_kv == n_head, an lm_head, q/k/v/o biases (permuted like the weights), F32 throughout
    spec = TinySpec(arch="llama", n_head=2, n_kv=2, head_dim=32, tied=False, attention_bias=True,
                    default_type=QT.Q8_0)
    path = tmp_path / "llama_bias.gguf"
    expected = write_tiny_gguf(path, spec)
    ckpt = load_gguf(path)
    _check_config(ckpt, spec)
    assert ckpt.config.attention_bias is True
    assert "lm_head.weight" in ckpt.tensor_names()
    _check_tensors(path, expected)


def test_qwen2_roundtrip(tmp_path: Path) -> None:
    spec = TinySpec(arch="qwen2", n_layers=3, n_head=4, n_kv=1, default_type=QT.Q4_1, tied=False,
                    theta=1e6, eps=1e-5)
    path = tmp_path / "qwen2.gguf"
    expected = write_tiny_gguf(path, spec)
    ckpt = load_gguf(path)
    assert ckpt.architecture == "Qwen2ForCausalLM"
    assert type(ckpt.config).__name__ == "Qwen2Config"
    _check_config(ckpt, spec)
    assert "model.layers.2.self_attn.k_proj.bias" in expected
    _check_tensors(path, expected)  # Qwen2 q/k are not permuted by llama.cpp


def test_qwen3_roundtrip(tmp_path: Path) -> None:
    # head_dim (32) != hidden / heads (16), as in real Qwen3 models; only key_length says so
    spec = TinySpec(arch="qwen3", n_head=4, n_kv=2, head_dim=32, write_key_length=True,
                    types={"q_proj.weight": QT.Q8_0, "v_proj.weight": QT.Q5_0}, default_type=QT.BF16)
    path = tmp_path / "qwen3.gguf"
    expected = write_tiny_gguf(path, spec)
    ckpt = load_gguf(path)
    assert ckpt.architecture == "Qwen3ForCausalLM"
    assert type(ckpt.config).__name__ == "Qwen3Config"
    _check_config(ckpt, spec)
    assert "model.layers.1.self_attn.q_norm.weight" in expected
    _check_tensors(path, expected)


def test_rope_scaling_from_metadata(tmp_path: Path) -> None:
    spec = TinySpec(arch="qwen2", context=4096)
    path = tmp_path / "yarn.gguf"
    write_tiny_gguf(path, spec, metadata={
        "qwen2.rope.scaling.type": "yarn", "qwen2.rope.scaling.factor": 4.0,
        "qwen2.rope.scaling.original_context_length": 1024,
    })
    rope = load_gguf(path).config.rope_parameters
    assert rope["rope_type"] == "yarn" and rope["factor"] == 4.0
    assert rope["original_max_position_embeddings"] == 1024

    path = tmp_path / "linear.gguf"
    write_tiny_gguf(path, TinySpec(), metadata={"llama.rope.scaling.type": "linear",
                                                "llama.rope.scaling.factor": 2.0})
    assert load_gguf(path).config.rope_parameters["rope_type"] == "linear"


def _llama3_freqs(head_dim: int, theta: float, factor: float) -> np.ndarray:
    """rope_freqs as llama.cpp's converter writes it for Llama 3.1 (low 1, high 4, 8192 tokens)."""
    out = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * np.pi * theta ** (i / head_dim)
        if wavelen < 8192 / 4:
            out.append(1.0)
        elif wavelen > 8192 / 1:
            out.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, dtype=np.float32)


def test_llama3_rope_freqs_become_rope_scaling(tmp_path: Path) -> None:
    spec = TinySpec(arch="llama", head_dim=128, n_head=2, n_kv=1, hidden=256, theta=500000.0, context=131072)
    path = tmp_path / "llama3.gguf"
    freqs = _llama3_freqs(128, 500000.0, 8.0)
    assert ((freqs > 1) & (freqs < 8)).sum() >= 4  # the blend region is exercised
    expected = write_tiny_gguf(path, spec, extra_tensors={"rope_freqs.weight": (freqs, None)})
    ckpt = load_gguf(path)
    assert ckpt.config.rope_parameters == {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192, "rope_theta": 500000.0,
    }
    assert "rope_freqs.weight" not in " ".join(ckpt.tensor_names())
    _check_tensors(path, expected)

    bad = tmp_path / "llama3_bad.gguf"
    write_tiny_gguf(bad, spec, extra_tensors={"rope_freqs.weight": (freqs ** 0.5, None)})
    with pytest.raises(ModelLoadError, match="rope_freqs"):
        load_gguf(bad)


def test_eos_includes_end_of_turn(tmp_path: Path) -> None:
    path = tmp_path / "eot.gguf"
    write_tiny_gguf(path, TinySpec(), metadata={"tokenizer.ggml.eos_token_id": 5,
                                                "tokenizer.ggml.eot_token_id": 7})
    assert load_gguf(path).config.eos_token_id == [5, 7]


# --------------------------------------------------------------------------------------------
# Errors: every one a ModelLoadError naming the file and the problem
# --------------------------------------------------------------------------------------------


def _raises(path: Path, *words: str, fn=load_gguf) -> str:
    with pytest.raises(ModelLoadError) as info:
        fn(path)
    msg = str(info.value)
    assert str(path) in msg and info.value.path == str(path)
    for word in words:
        assert word in msg, msg
    return msg


@pytest.fixture
def good_file(tmp_path: Path) -> Path:
    path = tmp_path / "good.gguf"
    write_tiny_gguf(path, TinySpec(default_type=QT.Q4_0), tokenizer=True)
    return path


def test_error_missing_file(tmp_path: Path) -> None:
    _raises(tmp_path / "nope.gguf", "no such file")
    _raises(tmp_path / "nope.gguf", "no such file", fn=load_gguf_tokenizer)
    _raises(tmp_path, "not a file")


def test_error_not_gguf(tmp_path: Path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"")
    _raises(path, "not a GGUF file", "empty")
    path.write_bytes(b'{"model_type": "llama"}' * 10)
    _raises(path, "not a GGUF file", "magic")
    _raises(path, "not a GGUF file", fn=load_gguf_tokenizer)


def test_error_truncated(good_file: Path, tmp_path: Path) -> None:
    data = good_file.read_bytes()
    reader = gguf.GGUFReader(good_file)
    data_end = max(t.data_offset + t.n_bytes for t in reader.tensors)
    header_end = reader.data_offset
    cut_points = [5, 30, 200, 1000, header_end - 40, header_end + 10, (header_end + data_end) // 2, data_end - 1]
    for i, cut in enumerate(cut_points):
        path = tmp_path / f"cut{i}.gguf"
        path.write_bytes(data[:cut])
        _raises(path, "truncated", f"{cut} bytes")
    _raises(path, "truncated", fn=load_gguf_tokenizer)


def test_error_corrupt_header(good_file: Path, tmp_path: Path) -> None:
    data = bytearray(good_file.read_bytes())
    data[4:8] = (99).to_bytes(4, "little")  # GGUF version 99
    path = tmp_path / "version.gguf"
    path.write_bytes(bytes(data))
    _raises(path, "unsupported GGUF format version 99")


def test_error_unsupported_architecture(tmp_path: Path) -> None:
    path = tmp_path / "gpt2.gguf"
    spec = TinySpec(arch="gpt2")
    write_tiny_gguf(path, spec)
    _raises(path, "unsupported architecture 'gpt2'")


def test_error_unsupported_quantization(tmp_path: Path, good_file: Path) -> None:
    # A type gguf knows but cannot dequantize (Q8_1), an integer type, and an unknown type id.
    path = tmp_path / "q8_1.gguf"
    _, type_size = gguf.GGML_QUANT_SIZES[QT.Q8_1]
    q8_1 = np.zeros((128, 2 * type_size), dtype=np.uint8)  # 128 rows of 64 values in 32-value blocks
    write_tiny_gguf(path, TinySpec(), drop=("blk.0.ffn_up.weight",),
                    extra_tensors={"blk.0.ffn_up.weight": (q8_1, QT.Q8_1)})
    _raises(path, "unsupported quantization type", "blk.0.ffn_up.weight", "Q8_1")

    path = tmp_path / "i32.gguf"
    write_tiny_gguf(path, TinySpec(), drop=("blk.1.attn_v.weight",),
                    extra_tensors={"blk.1.attn_v.weight": (np.zeros((32, 64), np.int32), None)})
    _raises(path, "unsupported quantization type", "I32")

    data = bytearray(good_file.read_bytes())
    at = tensor_type_offset(good_file, "blk.0.attn_q.weight")
    assert int.from_bytes(data[at : at + 4], "little") == QT.Q4_0
    data[at : at + 4] = (99).to_bytes(4, "little")
    path = tmp_path / "type99.gguf"
    path.write_bytes(bytes(data))
    _raises(path, "unsupported quantization type", "99")


def test_error_missing_tensor(tmp_path: Path) -> None:
    path = tmp_path / "missing.gguf"
    write_tiny_gguf(path, TinySpec(), drop=("blk.1.ffn_up.weight",))
    _raises(path, "missing tensor blk.1.ffn_up.weight")
    write_tiny_gguf(path, TinySpec(), drop=("token_embd.weight",))
    _raises(path, "missing tensor token_embd.weight")
    write_tiny_gguf(path, TinySpec(arch="qwen3"), drop=("blk.0.attn_k_norm.weight",))
    _raises(path, "missing tensor blk.0.attn_k_norm.weight")
    write_tiny_gguf(path, TinySpec(arch="qwen2"), drop=("blk.1.attn_v.bias",))
    _raises(path, "missing tensor blk.1.attn_v.bias")


def test_error_misshapen_or_unknown_tensor(tmp_path: Path) -> None:
    path = tmp_path / "shape.gguf"
    write_tiny_gguf(path, TinySpec(), drop=("blk.0.ffn_down.weight",),
                    extra_tensors={"blk.0.ffn_down.weight": (np.zeros((64, 64), np.float32), None)})
    _raises(path, "blk.0.ffn_down.weight", "shape (64, 64)", "(64, 128)")
    write_tiny_gguf(path, TinySpec(), extra_tensors={"blk.2.attn_q.weight": (np.zeros((64, 64), np.float32), None)})
    _raises(path, "unexpected tensor blk.2.attn_q.weight")


def test_error_missing_metadata(tmp_path: Path) -> None:
    path = tmp_path / "meta.gguf"
    write_tiny_gguf(path, TinySpec(), skip_metadata=("llama.embedding_length",))
    _raises(path, "llama.embedding_length", "missing")


def test_error_no_tokenizer(good_file: Path, tmp_path: Path) -> None:
    path = tmp_path / "notok.gguf"
    write_tiny_gguf(path, TinySpec())
    _raises(path, "no tokenizer", fn=load_gguf_tokenizer)


# --------------------------------------------------------------------------------------------
# Tokenizer
# --------------------------------------------------------------------------------------------

ROUND_TRIP = [
    "Hello world",
    " leading space",
    "   three leading spaces and trailing  ",
    "wörld naïve café — 日本語のテキスト 🙂👍🏽",
    "line one\nline two\n\n\ttabbed",
    "12345 + 678 = 999",
]


def _check_round_trip(tok) -> None:
    for text in ROUND_TRIP:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids and tok.decode(ids) == text, text
        assert tok.encode(tok.decode(ids), add_special_tokens=False) == ids


def test_tiny_tokenizer(good_file: Path) -> None:
    tok = load_gguf_tokenizer(good_file)
    tokens, _ = tiny_vocab()
    assert len(tok) == len(tokens)
    assert tok.bos_token == "<|endoftext|>" and tok.bos_token_id == tokens.index("<|endoftext|>")
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == tokens.index("<|im_end|>")
    assert tok.pad_token_id == tokens.index("<|endoftext|>")
    assert tok.chat_template == TINY_TEMPLATE
    _check_round_trip(tok)
    hello = [tokens.index("Ġ"), tokens.index("hell"), tokens.index("o")]
    assert tok.encode(" hello", add_special_tokens=False) == hello
    assert tok.encode("<|im_end|>", add_special_tokens=False) == [tok.eos_token_id]
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


# --------------------------------------------------------------------------------------------
# The bundled SmolLM2-135M-Instruct Q4_1 file against transformers
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundled() -> Path:
    return bundled_model_path()


@pytest.fixture(scope="module")
def hf_model(hf_bundled):
    """transformers' own GGUF loading of the bundled file (fp32): the session's shared copy
    (tests/conftest.py)."""
    return hf_bundled


def test_bundled_matches_transformers(bundled: Path, hf_model) -> None:
    ckpt = load_gguf(bundled)
    assert ckpt.architecture == "LlamaForCausalLM" == type(hf_model).__name__
    ours, theirs = ckpt.config, hf_model.config
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps",
                "tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id", "attention_bias",
                "mlp_bias", "hidden_act", "model_type"):
        assert getattr(ours, key) == getattr(theirs, key), key
    assert ours.rope_parameters == theirs.rope_parameters
    assert ours.tie_word_embeddings is True

    state = hf_model.state_dict()
    names = []
    for name, tensor in ckpt.tensors():
        names.append(name)
        assert tensor.dtype == torch.float32
        assert torch.equal(tensor, state[name]), name
    # transformers ties lm_head to the embedding; the file has no output.weight
    assert sorted(names) == sorted(set(state) - {"lm_head.weight"})
    assert ckpt.ggml_types()["model.layers.0.self_attn.q_proj.weight"] == "Q4_1"


def test_bundled_tokenizer(bundled: Path) -> None:
    tok = load_gguf_tokenizer(bundled)
    from tokenfab.loader.gguf import _open  # the parse load_gguf already cached

    reader_template = _open(bundled).fields["tokenizer.chat_template"].contents()
    assert reader_template.startswith("{% for message in messages %}")
    assert tok.chat_template == reader_template
    assert (tok.bos_token, tok.bos_token_id) == ("<|im_start|>", 1)
    assert (tok.eos_token, tok.eos_token_id) == ("<|im_end|>", 2)
    assert tok.pad_token_id == 2
    assert len(tok) == 49152
    _check_round_trip(tok)
    assert tok.encode("Hello world", add_special_tokens=False) == [19556, 905]
    assert tok.encode("12345", add_special_tokens=False) == [33, 34, 35, 36, 37]  # digits split, as SmolLM2's
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2+2?"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    )
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
    assert ids[0] == tok.bos_token_id and tok.decode(ids).endswith("<|im_start|>assistant\n")


def test_odd_file_name(good_file: Path, tmp_path: Path) -> None:
    """Paths with spaces and no .gguf suffix work for both the weights and the tokenizer."""
    path = tmp_path / "my model copy.bin"
    shutil.copyfile(good_file, path)
    assert load_gguf_tokenizer(path).eos_token == "<|im_end|>"
    assert load_gguf(path).config.num_hidden_layers == 2
