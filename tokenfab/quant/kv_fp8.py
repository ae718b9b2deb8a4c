"""FP8 KV cache: which layers store their keys/values as float8 e4m3, and with which scales.

``--kv-cache-dtype fp8_e4m3`` (``fp8`` is vLLM's alias) stores every cache-owning layer's entries as
``torch.float8_e4m3fn``: a value x is stored as ``e4m3(clamp(x / scale, -448, 448))`` and read back as
``float(stored) * scale``, with one float32 scale for the keys and one for the values of each layer
(MLA: one for the latent + rope entry). Memory per token halves against bfloat16 (a quarter of float32).

Scales, per layer:
- from the checkpoint when it ships them (``*.k_scale`` / ``*.v_scale``, as vLLM reads them:
  ``self_attn.k_proj.k_scale`` (ModelOpt), ``self_attn.k_scale`` (compressed-tensors ``kv_cache_scheme``),
  ``self_attn.attn.k_scale``; the deprecated ``*.kv_scale`` serves both);
- else calibrated once, on the first batch that writes the layer: ``amax(|x|) / 448`` over that batch's
  keys (values), computed on the device (no host sync). This is a one-shot calibration: the scale never
  changes afterwards (cached blocks, prefix-cache hits included, stay valid), and a later value beyond
  that first batch's range saturates at +-448 * scale.

``--kv-cache-dtype-skip-layers`` keeps some layers in the model dtype: layer indices (the order of the
cache-owning layers, which is the decoder-layer order) and/or ``sliding_window`` (every layer with a
sliding window, as vLLM has). DSA layers (DeepSeek-V3.2 / GLM-5) store their index key in the same
FP8 row under the same scale (the indexer reads it unscaled: its top-k is invariant to a positive scale).

The model runner (``engine/runner/model_runner.py``) allocates one cache tensor per dtype and binds each
layer's slices and scales; the layers (``layers/attention.py``, ``layers/mla.py``) pass the scales to
the kernels.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
from torch import nn

log = logging.getLogger("tokenfab")

FP8_MAX = 448.0  # the largest finite float8_e4m3fn value
#: ``--kv-cache-dtype`` values: None = the model dtype
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
}
#: the smallest amax a calibration takes (an all-zero first batch would give scale 0 and NaN reads)
MIN_AMAX = 1e-4
#: checkpoint name endings of k/v scales -> which scale(s) they give
_SCALE_SUFFIXES = {".k_scale": ("k",), ".v_scale": ("v",), ".kv_scale": ("k", "v")}
#: module steps between the attention block and our cache-owning module in checkpoint names
_SCALE_HOPS = (".k_proj", ".v_proj", ".attn", ".mla_attn", ".kv_a_proj_with_mqa")


def parse_kv_cache_dtype(name: str | None) -> torch.dtype | None:
    """``--kv-cache-dtype`` -> the cache dtype (None: the model dtype); a clear ValueError otherwise."""
    key = "auto" if name is None else str(name).lower()
    if key not in KV_CACHE_DTYPES:
        extra = " (e5m2 is not supported: e4m3 keeps more precision)" if "e5m2" in key else ""
        raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; got {name!r}{extra}")
    return KV_CACHE_DTYPES[key]


def parse_skip_layers(spec: str | Iterable[int | str] | None) -> tuple[set[int], bool]:
    """``--kv-cache-dtype-skip-layers``: "0,5,sliding_window" (or a list) -> (indices, skip sliding-window layers)."""
    if spec is None:
        return set(), False
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    indices: set[int] = set()
    sliding = False
    for item in items:
        text = str(item).strip()
        if not text:
            continue
        if text == "sliding_window":
            sliding = True
            continue
        try:
            indices.add(int(text))
        except ValueError:
            raise ValueError(f"kv_cache_dtype_skip_layers takes layer indices and/or 'sliding_window', "
                             f"not {text!r}") from None
    return indices, sliding


def owns_kv_cache(module: nn.Module) -> bool:
    """Whether a module owns per-token cache entries: it has a ``k_cache`` slot for the runner to bind
    (``layers.attention.Attention``) or declares ``kv_cache_spec()`` (MLA's latent cache). A protocol
    rather than an isinstance check, so that this format module needs nothing from the layers above it."""
    return hasattr(module, "k_cache") or callable(getattr(module, "kv_cache_spec", None))


def cache_modules(model: nn.Module) -> list[nn.Module]:
    """The cache-owning modules (:func:`owns_kv_cache`) in layer order."""
    return [m for m in model.modules() if owns_kv_cache(m)]


def cache_dtype(module: nn.Module, default: torch.dtype) -> torch.dtype:
    """The dtype a layer's cache entries are stored in (its ``kv_cache_dtype``, else ``default``)."""
    return getattr(module, "kv_cache_dtype", None) or default


def configure_kv_cache(model: nn.Module, kv_cache_dtype: str | None,
                       skip_layers: str | Iterable[int | str] | None = None) -> list[int]:
    """Set ``kv_cache_dtype`` on every cache-owning module (None: the model dtype) from the flags;
    returns the indices of the layers stored in FP8. Bad values raise ValueError before anything
    is allocated (unknown dtype, an index outside the model's layers)."""
    dtype = parse_kv_cache_dtype(kv_cache_dtype)
    indices, sliding = parse_skip_layers(skip_layers)
    modules = cache_modules(model)
    bad = sorted(i for i in indices if not -len(modules) <= i < len(modules))
    if bad:
        raise ValueError(f"kv_cache_dtype_skip_layers: layer {bad[0]} is out of range (the model has "
                         f"{len(modules)} attention layers: 0..{len(modules) - 1})")
    if (indices or sliding) and dtype is None:
        log.info("--kv-cache-dtype-skip-layers has no effect with --kv-cache-dtype auto")
    indices = {i % len(modules) for i in indices} if modules else set()
    fp8: list[int] = []
    for i, m in enumerate(modules):
        keep = dtype is None or i in indices or (sliding and getattr(m, "sliding_window", 0) > 0)
        m.kv_cache_dtype = None if keep else dtype
        if not keep:
            fp8.append(i)
    if dtype is not None:
        with_ckpt = sum(1 for i in fp8 if getattr(modules[i], "checkpoint_kv_scales", None))
        log.info("KV cache: %d of %d layers in %s (%d with checkpoint scales, the others calibrated on their "
                 "first batch)", len(fp8), len(modules), str(dtype).removeprefix("torch."), with_ckpt)
    return fp8


# ---------------------------------------------------------------- checkpoint scales


def kv_scale_kind(name: str) -> tuple[str, ...] | None:
    """Which scales a checkpoint tensor name gives (("k",), ("v",), ("k", "v")), None if not a KV scale."""
    for suffix, kinds in _SCALE_SUFFIXES.items():
        if name.endswith(suffix):
            return kinds
    return None


def kv_scale_owner(name: str, modules: dict[str, nn.Module]) -> nn.Module | None:
    """The cache-owning module a KV-scale name belongs to: the name without its suffix, less the
    hops between the attention block and the cache module (``k_proj``, ``attn`` ...), then that block
    itself or its ``attn`` child."""
    base = name.rsplit(".", 1)[0]
    stem = base
    while True:
        for hop in _SCALE_HOPS:
            if stem.endswith(hop):
                stem = stem[: -len(hop)]
                break
        else:
            break
    for candidate in (base, stem, stem + ".attn"):
        m = modules.get(candidate)
        if m is not None and owns_kv_cache(m):
            return m
    return None


def take_kv_scale(name: str, tensor: torch.Tensor, modules: dict[str, nn.Module]) -> bool:
    """Record a checkpoint's k/v scale on its layer (``checkpoint_kv_scales``: {"k": float, "v": float});
    False when the name is no KV scale. A KV scale with no layer to take it is a ValueError. A
    per-head scale (several values) is taken as its maximum (no stored value saturates)."""
    kinds = kv_scale_kind(name)
    if kinds is None:
        return False
    owner = kv_scale_owner(name, modules)
    if owner is None:
        raise ValueError(f"KV-cache scale {name}: no attention layer of this model takes it")
    if tensor.numel() == 0 or not (tensor.is_floating_point()):
        raise ValueError(f"KV-cache scale {name} must be a float tensor, got {tensor.dtype} {tuple(tensor.shape)}")
    value = float(tensor.detach().float().abs().max())
    if not value > 0 or value == float("inf"):
        raise ValueError(f"KV-cache scale {name} must be positive and finite, got {value}")
    scales = dict(getattr(owner, "checkpoint_kv_scales", None) or {})
    for kind in kinds:
        scales[kind] = value
    owner.checkpoint_kv_scales = scales
    return True


# ---------------------------------------------------------------- first-batch calibration


def calibrate_scale_(scale: torch.Tensor, x: torch.Tensor) -> None:
    """``scale`` [1] float32 <- max(amax(|x|), MIN_AMAX) / 448, on the device (no host sync)."""
    amax = x.detach().abs().amax().float().clamp(min=MIN_AMAX)
    scale.copy_((amax / FP8_MAX).reshape(1))


def bind_scales(modules: list[nn.Module], device: torch.device) -> torch.Tensor | None:
    """One float32 tensor [n, 2] of (k, v) scales for the FP8 layers among ``modules``; each layer gets
    views ``k_scale`` / ``v_scale`` of shape [1] (MLA: ``kv_scale``), set from its checkpoint scales, or
    ``kv_calibrate`` = True (calibrated on its first batch). Layers in the model dtype get None."""
    fp8 = [m for m in modules if getattr(m, "kv_cache_dtype", None) is not None]
    for m in modules:
        m.k_scale = m.v_scale = None
        m.kv_calibrate = False
        if hasattr(m, "kv_scale"):
            m.kv_scale = None
    if not fp8:
        return None
    scales = torch.ones(len(fp8), 2, dtype=torch.float32)
    for i, m in enumerate(fp8):
        ckpt = getattr(m, "checkpoint_kv_scales", None) or {}
        if ckpt:
            k = ckpt.get("k", ckpt.get("v"))
            v = ckpt.get("v", k)
            if callable(getattr(m, "kv_cache_spec", None)):  # MLA: one scale for the latent row
                k = v = max(k, v)
            scales[i, 0], scales[i, 1] = k, v
    scales = scales.to(device)
    for i, m in enumerate(fp8):
        m.k_scale, m.v_scale = scales[i, 0:1], scales[i, 1:2]
        if hasattr(m, "kv_scale"):
            m.kv_scale = m.k_scale
        m.kv_calibrate = not getattr(m, "checkpoint_kv_scales", None)
    return scales
