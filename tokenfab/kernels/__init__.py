"""Triton kernels with PyTorch references, registered as torch custom ops (``torch.ops.tokenfab``)."""

from tokenfab.kernels.activation import gelu_and_mul, silu_and_mul
from tokenfab.kernels.attention import paged_attention
from tokenfab.kernels.kv_cache import store_kv
from tokenfab.kernels.norm import add_rms_norm, rms_norm
from tokenfab.kernels.rope import rotary_embedding
from tokenfab.kernels.sampling import sample

__all__ = [
    "add_rms_norm",
    "gelu_and_mul",
    "paged_attention",
    "rms_norm",
    "rotary_embedding",
    "sample",
    "silu_and_mul",
    "store_kv",
]
