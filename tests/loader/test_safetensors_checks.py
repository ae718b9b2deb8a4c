"""The safetensors loader refuses what it cannot load, with the file and the format named.

The checkpoints are written here in each format's official on-disk layout (from the formats'
own descriptions, not from our loader): DeepSeek's FP8 block checkpoints (float8_e4m3fn weights
plus float32 ``weight_scale_inv`` per 128x128 block), compressed-tensors ``pack-quantized``
(int32 ``weight_packed``, ``weight_scale``, ``weight_shape``) and OpenAI's MXFP4
(uint8 ``*_blocks`` / ``*_scales``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from tests.tiny_models import tiny_config
from tokenfab.loader.errors import ModelLoadError
from tokenfab.loader.model_loader import load_model

FP8_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
PACKED_CONFIG = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}},
    "ignore": ["lm_head"],
}
MXFP4_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn", "lm_head"]}


@pytest.fixture(scope="module")
def tiny_llama() -> tuple[dict, dict[str, torch.Tensor]]:
    """The config dict and a random fp32 state dict of a tiny Llama (HF names)."""
    import transformers

    config = tiny_config("llama")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    return config.to_dict(), {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def _write(path: Path, config: dict, tensors: dict[str, torch.Tensor], shards: int = 1,
           quantization_config: dict | None = None) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    cfg = dict(config, architectures=["LlamaForCausalLM"])
    if quantization_config is not None:
        cfg["quantization_config"] = quantization_config
    (path / "config.json").write_text(json.dumps(cfg))
    names = sorted(tensors)
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    weight_map = {}
    for i in range(shards):
        part = names[i::shards]
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        save_file({n: tensors[n] for n in part}, str(path / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in part})
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return path


def _load(path: Path):
    return load_model(path, torch.float32, torch.device("cpu"), load_tokenizer=False)


def _fp8_block(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek's layout: w ~ fp8 * scale_inv per 128x128 block (scale_inv [ceil(out/128), ceil(in/128)])."""
    out, inp = w.shape
    scale = torch.full(((out + 127) // 128, (inp + 127) // 128), float(w.abs().max()) / 448.0)
    return (w / scale[0, 0]).to(torch.float8_e4m3fn), scale


def _pack_int4(w: torch.Tensor) -> dict[str, torch.Tensor]:
    """compressed-tensors pack-quantized: eight 4-bit values per int32, group scales, the shape."""
    out, inp = w.shape
    scale = w.abs().reshape(out, inp // 32, 32).amax(-1) / 7
    q = (w.reshape(out, inp // 32, 32) / scale[..., None]).round().clamp(-8, 7).to(torch.int32).reshape(out, inp)
    u = (q + 8).reshape(out, inp // 8, 8)
    packed = torch.zeros(out, inp // 8, dtype=torch.int64)
    for i in range(8):
        packed |= u[..., i].long() << (4 * i)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    return {"weight_packed": packed, "weight_scale": scale.to(torch.bfloat16),
            "weight_shape": torch.tensor([out, inp], dtype=torch.int32)}


def _quantized(tensors: dict[str, torch.Tensor], kind: str) -> dict[str, torch.Tensor]:
    out = {}
    for name, t in tensors.items():
        is_linear = name.endswith("_proj.weight")
        if not is_linear:
            out[name] = t
        elif kind == "fp8":
            out[name], out[name + "_scale_inv"] = _fp8_block(t)
        elif kind == "packed":
            out.update({f"{name[: -len('weight')]}{k}": v for k, v in _pack_int4(t).items()})
        elif kind == "mxfp4":
            base = name[: -len(".weight")]
            blocks = torch.randint(0, 256, (t.shape[0], t.shape[1] // 32, 16), dtype=torch.uint8)
            out[base + "_blocks"] = blocks
            out[base + "_scales"] = torch.full((t.shape[0], t.shape[1] // 32), 127, dtype=torch.uint8)
    return out


def test_plain_checkpoint_loads(tmp_path, tiny_llama):
    """The control: the unquantized checkpoint (sharded, with a rotary inv_freq buffer) loads exactly."""
    config, tensors = tiny_llama
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(8)}
    loaded = _load(_write(tmp_path / "m", config, {**tensors, **extra}, shards=3))
    ours = dict(loaded.model.named_parameters())
    torch.testing.assert_close(ours["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("kind,file_fragment", [
    ("fp8", "FP8 block-quantized"),
    ("packed", "compressed-tensors pack-quantized"),
    ("mxfp4", "MXFP4"),
])
def test_quantized_tensors_without_config_are_refused_naming_format_and_shard(tmp_path, tiny_llama, kind,
                                                                              file_fragment):
    """Without a quantization_config (a stripped or hand-made config), the first quantized tensor's
    dtype names the shard it sits in and the format."""
    config, tensors = tiny_llama
    path = _write(tmp_path / kind, config, _quantized(tensors, kind), shards=2)
    with pytest.raises(ModelLoadError) as info:
        _load(path)
    msg = str(info.value)
    assert "unsupported quantized checkpoint" in msg
    assert Path(info.value.path).parent == path and info.value.path.endswith(".safetensors")
    assert file_fragment in msg
    # the named tensor is really in the named shard
    from safetensors import safe_open

    with safe_open(info.value.path, framework="pt") as fh:
        assert any(f"tensor {n} " in msg for n in fh.keys())


@pytest.mark.parametrize("qc,fragment", [
    (dict(FP8_CONFIG, weight_block_size=[64, 64]), "FP8 (block-quantized, weight_block_size [64, 64]"),
    ({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "static"}, "per-tensor FP8"),
    (dict(FP8_CONFIG, fmt="e5m2"), "fmt e5m2"),
    ({"quant_method": "gptq", "bits": 4, "group_size": 128}, "GPTQ (4-bit)"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "bitsandbytes"),
])
def test_unsupported_quantization_config_is_refused_naming_config(tmp_path, tiny_llama, qc, fragment):
    """A quantization_config no tokenfab.quant format loads: the refusal names config.json and the
    format, and lists what does load (block FP8 among them)."""
    config, tensors = tiny_llama
    path = _write(tmp_path / "q", config, _quantized(tensors, "fp8"), quantization_config=qc)
    with pytest.raises(ModelLoadError) as info:
        _load(path)
    msg = str(info.value)
    assert info.value.path == str(path / "config.json")
    assert "unsupported quantized checkpoint" in msg and fragment in msg


def test_fp8_block_checkpoint_with_config_loads(tmp_path, tiny_llama):
    """The same float8 tensors with their quantization_config load (tokenfab.quant.fp8_block), the
    weights kept float8, and compute what the dequantized weights compute."""
    from tokenfab.quant.fp8_block import FP8Linear

    config, tensors = tiny_llama
    q = _quantized(tensors, "fp8")
    loaded = _load(_write(tmp_path / "fp8", config, q, shards=2, quantization_config=FP8_CONFIG))
    layer = loaded.model.model.layers[1].mlp.down_proj
    assert isinstance(layer, FP8Linear) and layer.qweight.dtype == torch.float8_e4m3fn
    w = q["model.layers.1.mlp.down_proj.weight"].float() * q["model.layers.1.mlp.down_proj.weight_scale_inv"][0, 0]
    x = torch.randn(3, w.shape[1])
    torch.testing.assert_close(layer(x), x @ w.T)


def test_fp8_weight_scale_inv_alone_is_not_dropped(tmp_path, tiny_llama):
    """A scale tensor beside plain weights (a half-converted checkpoint) is reported, not dropped."""
    config, tensors = tiny_llama
    stray = {"model.layers.1.mlp.down_proj.weight_scale_inv": torch.ones(1, 1)}
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.mlp\.down_proj\.weight_scale_inv"):
        _load(_write(tmp_path / "m", config, {**tensors, **stray}))


def test_stray_tensor_is_reported_by_name_and_file(tmp_path, tiny_llama):
    config, tensors = tiny_llama
    stray = {"model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)}
    path = _write(tmp_path / "m", config, {**tensors, **stray}, shards=2)
    with pytest.raises(ModelLoadError) as info:
        _load(path)
    assert "model.layers.0.self_attn.q_proj.lora_A.weight" in str(info.value)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    assert info.value.path == str(path / index["model.layers.0.self_attn.q_proj.lora_A.weight"])


def test_layers_beyond_the_config_are_reported(tmp_path, tiny_llama):
    """A checkpoint with more layers than config.json says (a wrong config) does not load half a model."""
    config, tensors = tiny_llama
    extra = {n.replace("layers.1.", "layers.2."): t.clone() for n, t in tensors.items() if "layers.1." in n}
    with pytest.raises(ModelLoadError, match=r"model\.layers\.2\.") as info:
        _load(_write(tmp_path / "m", config, {**tensors, **extra}))
    assert "and 4 more" in str(info.value)  # 9 stray tensors: five named, the rest counted


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/../../outside.safetensors"])
def test_hostile_index_is_refused(tmp_path, tiny_llama, shard):
    config, tensors = tiny_llama
    path = _write(tmp_path / "m", config, tensors, shards=2)
    save_file({"x": torch.zeros(1)}, str(tmp_path / "outside.safetensors"))
    index = path / "model.safetensors.index.json"
    data = json.loads(index.read_text())
    first = next(iter(data["weight_map"]))
    data["weight_map"][first] = shard
    index.write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match="outside the model folder") as info:
        _load(path)
    assert info.value.path == str(index)


def test_shard_link_leading_outside_is_refused(tmp_path, tiny_llama):
    config, tensors = tiny_llama
    path = _write(tmp_path / "m", config, tensors, shards=2)
    shard = path / "model-00002-of-00002.safetensors"
    os.replace(shard, tmp_path / "elsewhere.safetensors")
    shard.symlink_to(tmp_path / "elsewhere.safetensors")
    with pytest.raises(ModelLoadError, match="link leading outside"):
        _load(path)
    # the same without an index (the *.safetensors glob)
    single = _write(tmp_path / "single", config, tensors)
    os.replace(single / "model.safetensors", tmp_path / "single.safetensors")
    (single / "model.safetensors").symlink_to(tmp_path / "single.safetensors")
    with pytest.raises(ModelLoadError, match="link leading outside"):
        _load(single)


def test_hub_cache_snapshot_links_load(tmp_path, tiny_llama):
    """The Hugging Face cache layout (snapshot files are links to ../../blobs/<hash>) still loads."""
    config, tensors = tiny_llama
    repo = tmp_path / "models--org--tiny"
    snap = _write(repo / "snapshots" / "abc123", config, tensors, shards=2)
    (repo / "blobs").mkdir()
    for f in sorted(snap.glob("*.safetensors")):
        blob = repo / "blobs" / f"sha-{f.stem}"
        os.replace(f, blob)
        f.symlink_to(os.path.relpath(blob, snap))
    loaded = _load(snap)
    assert loaded.model is not None


def test_mistral_consolidated_copy_is_not_read(tmp_path, tiny_llama):
    """Mistral repositories hold consolidated.safetensors (their native names) beside the HF file:
    it is the same model again, not stray tensors."""
    config, tensors = tiny_llama
    path = _write(tmp_path / "m", config, tensors)
    save_file({"layers.0.attention.wq.weight": tensors["model.layers.0.self_attn.q_proj.weight"]},
              str(path / "consolidated.safetensors"))
    assert _load(path).model is not None


def test_renamed_tensor_names_both_sides(tmp_path, tiny_llama):
    """A tensor under a name we do not know is reported, and so is the parameter it left empty."""
    config, tensors = tiny_llama
    renamed = dict(tensors)
    renamed["model.layers.0.self_attn.q.weight"] = renamed.pop("model.layers.0.self_attn.q_proj.weight")
    with pytest.raises(ModelLoadError) as info:
        _load(_write(tmp_path / "m", config, renamed))
    msg = str(info.value)
    assert "takes: model.layers.0.self_attn.q.weight" in msg
    assert "1 parameters are missing: model.layers.0.self_attn.qkv_proj.weight (shard 0)" in msg


def test_fp8_block_checkpoint_missing_or_misshapen_scale(tmp_path, tiny_llama):
    """A block-FP8 checkpoint that lacks a scale, or has one of the wrong grid, is refused naming it."""
    config, tensors = tiny_llama
    q = _quantized(tensors, "fp8")
    lacking = {k: v for k, v in q.items() if k != "model.layers.0.self_attn.k_proj.weight_scale_inv"}
    with pytest.raises(ModelLoadError, match=r"missing tensors: .*qkv_proj\.weight_scale_inv \(shard 1\)"):
        _load(_write(tmp_path / "a", config, lacking, quantization_config=FP8_CONFIG))
    bad = dict(q, **{"model.layers.0.mlp.down_proj.weight_scale_inv": torch.ones(2, 2)})
    with pytest.raises(ModelLoadError, match=r"down_proj\.weight_scale_inv: weight_scale_inv has shape \(2, 2\), "
                                             r"expected \(1, 1\)"):
        _load(_write(tmp_path / "b", config, bad, quantization_config=FP8_CONFIG))
    plain = dict(q, **{"model.layers.0.mlp.down_proj.weight": tensors["model.layers.0.mlp.down_proj.weight"]})
    with pytest.raises(ModelLoadError, match=r"down_proj\.weight: is stored as float32"):
        _load(_write(tmp_path / "c", config, plain, quantization_config=FP8_CONFIG))
