"""``--quantization`` for GGUF files: whether block-quantized weights run packed, and how.

- ``None`` (default): packed (``gguf``) for a GGUF file with Q8_0/Q4_0/Q4_1 tensors on CPU in
  float32 when the native kernels are built; otherwise dequantized to ``--dtype`` as before.
- ``gguf``: packed weights, float32 activations (W4A32/W8A32): greedy output token-identical to
  ``transformers`` in float32 on the bundled model.
- ``gguf-q8act``: packed weights and int8 activation blocks (llama.cpp's Q8_0/Q8_1 activation
  quantization, int8 dot products); faster, drifts from float32 (measured in the README).
- ``none``: dequantize every tensor to ``--dtype`` at load (the float32 path of before).
- ``fp8`` / ``fp8-block`` (safetensors directories only): quantize float weights to FP8 at load.
"""

from __future__ import annotations

import logging

import torch

from tokenfab.loader.gguf import PACKABLE_TYPES, GGUFCheckpoint

log = logging.getLogger("tokenfab")

# online quantization of a float safetensors directory (tokenfab.quant.online): FP8 weights with
# per-output-channel scales ("fp8") or 128x128 block scales ("fp8-block")
ONLINE_CHOICES = ("fp8", "fp8-block")
QUANTIZATION_CHOICES = ("gguf", "gguf-q8act", "none", *ONLINE_CHOICES)
_ACT = {"gguf": "f32", "gguf-q8act": "q8"}


def check_quantization_arg(quantization: str | None) -> None:
    if quantization is not None and quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)} (or unset); "
                         f"got {quantization!r}")


def native_ggml_available() -> bool:
    """Whether the packed products run in native code (else they would dequantize every call)."""
    try:
        from tokenfab.kernels.cpu import native_library

        lib = native_library()
    except (ImportError, OSError):
        return False
    return lib is not None and hasattr(lib, "ggml_matmul_f32")


def resolve_gguf_mode(quantization: str | None, ckpt: GGUFCheckpoint, dtype: torch.dtype,
                      device: torch.device) -> str | None:
    """The activation mode of the packed layers ("f32"/"q8"), or None to dequantize at load."""
    check_quantization_arg(quantization)
    if quantization == "none":
        return None
    packable = any(t in PACKABLE_TYPES for t in ckpt.ggml_types().values())
    if quantization is None:
        if not packable or device.type != "cpu" or dtype != torch.float32:
            return None
        if not native_ggml_available():
            log.info("GGUF weights dequantized to float32: the native ggml kernels are not available")
            return None
        return "f32"
    if device.type != "cpu":
        raise ValueError(f"--quantization {quantization} runs on CPU only (packed ggml kernels); "
                         "use --quantization none on CUDA")
    if dtype != torch.float32:
        raise ValueError(f"--quantization {quantization} computes in float32; drop --dtype or use "
                         "--quantization none to dequantize to another dtype")
    if not packable:
        log.warning("--quantization %s: %s has no Q8_0/Q4_0/Q4_1 tensors; nothing runs packed",
                    quantization, ckpt.path)
    return _ACT[quantization]
