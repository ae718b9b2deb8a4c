"""Building a model from a path: Hugging Face directory or GGUF file (or the bundled model)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tokenfab.layers.tp_split import TPSplitError
from tokenfab.loader.bundled import BUNDLED_MODEL_NAME, bundled_model_path
from tokenfab.loader.errors import ModelLoadError
from tokenfab.loader.formats import check_quantization_config
from tokenfab.loader.gguf import load_gguf, load_gguf_tokenizer
from tokenfab.loader.gguf_mode import ONLINE_CHOICES, check_quantization_arg, resolve_gguf_mode
from tokenfab.loader.gguf_packed import load_gguf_packed
from tokenfab.loader.quant_apply import apply_quant_method, materialize, weights_on_meta
from tokenfab.loader.safetensors_dir import iter_safetensors, load_hf_config
from tokenfab.loader.tiktoken_tokenizer import is_tiktoken_dir, load_tiktoken_tokenizer
from tokenfab.loader.weights import load_weights
from tokenfab.models.registry import resolve_model_class
from tokenfab.quant.config import UnsupportedQuantization
from tokenfab.quant.online import online_quant_method


@dataclass
class LoadedModel:
    model: nn.Module
    config: Any  # transformers config
    tokenizer: Any | None  # transformers tokenizer; None when the directory has none
    name: str
    path: Path


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _build(arch: str, config: Any, dtype: torch.dtype, device: torch.device, max_position: int, source: Path,
           meta_weights: bool = False):
    """The model, its weights allocated (uninitialised) on ``device``; ``meta_weights``: the layers'
    weights on "meta" (:func:`tokenfab.loader.quant_apply.weights_on_meta`), for a quantized build."""
    try:
        cls = resolve_model_class(arch)
    except KeyError as e:
        raise ModelLoadError(source, str(e.args[0])) from e
    try:
        with _default_dtype(dtype), torch.device(device):
            if not meta_weights:
                return cls(config, max_position=max_position)
            with weights_on_meta():
                return cls(config, max_position=max_position)
    except TPSplitError as e:  # e.g. 9 heads at --tensor-parallel-size 2
        raise ModelLoadError(source, f"cannot be split for tensor parallelism: {e}") from e


def _hf_tokenizer(model_dir: Path) -> Any | None:
    if is_tiktoken_dir(model_dir):  # Kimi K2/K2.5: tiktoken.model, loaded without remote code
        return load_tiktoken_tokenizer(model_dir)
    if not any((model_dir / f).is_file() for f in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        return None
    from transformers import AutoTokenizer  # lazy: transformers takes seconds to import

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as e:
        raise ModelLoadError(model_dir, f"cannot load the tokenizer: {e}") from e


def text_config(config: Any) -> Any:
    """The language model's config (multimodal configs such as Kimi K2.5 nest it)."""
    get = getattr(config, "get_text_config", None)
    return get() if callable(get) else config


def config_max_len(config: Any) -> int:
    return int(getattr(text_config(config), "max_position_embeddings", None) or 4096)


def load_model(
    path: str | Path | None,
    dtype: torch.dtype,
    device: torch.device,
    max_model_len: int | None = None,
    load_tokenizer: bool = True,
    quantization: str | None = None,
) -> LoadedModel:
    """Load config, weights (in ``dtype`` on ``device``) and tokenizer.

    ``path`` is a directory with config.json + safetensors, a .gguf file, or None for the
    bundled SmolLM2-135M-Instruct. ``quantization`` (GGUF files): see
    :func:`tokenfab.loader.gguf_mode.resolve_gguf_mode`; None picks packed weights for a quantized
    GGUF file on CPU in float32. "fp8" / "fp8-block" quantize float weights online
    (tokenfab.quant.online; a GGUF file is dequantized first). A quantized checkpoint
    (quantization_config) loads through its tokenfab.quant format, its weights kept packed.
    """
    check_quantization_arg(quantization)
    name, gguf_act = None, None
    if path is None:
        path, name = bundled_model_path(), BUNDLED_MODEL_NAME
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(path, "no such file or directory")
    if path.is_dir() and quantization not in (None, "none", *ONLINE_CHOICES):
        raise ValueError(f"--quantization {quantization} applies to .gguf files; a directory takes "
                         f"{', '.join(ONLINE_CHOICES)} (online quantization); {path} is a directory")
    quant_method = None
    if quantization in ONLINE_CHOICES:
        quant_method = online_quant_method(quantization)
    if path.is_file() and path.suffix == ".gguf":
        ckpt = load_gguf(path)
        config, arch, weights = ckpt.config, ckpt.architecture, ckpt.tensors()
        # online FP8 of a GGUF file: its tensors dequantized at load, then quantized to FP8
        gguf_act = resolve_gguf_mode("none" if quant_method else quantization, ckpt, dtype, device)
        tokenizer = load_gguf_tokenizer(path) if load_tokenizer else None
    elif path.is_dir():
        config = load_hf_config(path)
        archs = getattr(config, "architectures", None) or []
        if not archs:
            raise ModelLoadError(path / "config.json", "config.json names no `architectures`")
        ckpt_method = check_quantization_config(path / "config.json", archs[0])
        if ckpt_method is not None and quant_method is not None:
            raise ValueError(f"--quantization {quantization}: {path} is already quantized "
                             f"({ckpt_method.describe()}); drop the flag")
        quant_method = quant_method or ckpt_method
        arch, weights = archs[0], iter_safetensors(path)
        tokenizer = _hf_tokenizer(path) if load_tokenizer else None
    else:
        raise ModelLoadError(path, "expected a model directory or a .gguf file")
    max_len = min(max_model_len or config_max_len(config), config_max_len(config))
    # quantized: the float weights of the layers the format replaces are never allocated
    model = _build(arch, config, dtype, device, max_len, path, meta_weights=quant_method is not None)
    if quant_method is not None:
        try:
            with _default_dtype(dtype), torch.device(device):
                apply_quant_method(model, quant_method)
        except UnsupportedQuantization as e:  # a layer the format's variant cannot serve
            where = path / "config.json" if path.is_dir() else path
            raise ModelLoadError(where, f"unsupported quantized checkpoint: {quant_method.describe()}: {e}") from e
        materialize(model, device)
        model.quant_method = quant_method
    if path.suffix == ".gguf" and gguf_act is not None:
        load_gguf_packed(model, ckpt, act=gguf_act)
    else:
        load_weights(model, weights, path)
    model.eval()
    return LoadedModel(model, config, tokenizer, name or path.stem if path.is_file() else name or path.name, path)
