"""Weight bytes of a loaded model, quantized layers counted as stored (packed values + scales)."""

from __future__ import annotations

from torch import nn

from tokenfab.quant.base import QuantizedModule


def quantized_bytes(model: nn.Module) -> tuple[int, int]:
    """(bytes held, parameters stood for) by the quantized layers and experts of ``model`` (their
    buffers: packed weights, scale grids, biases). Their parameters are not in ``model.parameters()``."""
    nbytes = numel = 0
    for m in model.modules():
        if isinstance(m, QuantizedModule):
            held, params = m.weight_bytes()
            nbytes, numel = nbytes + held, numel + params
    return nbytes, numel


def weight_bytes_report(model: nn.Module) -> dict:
    """Bytes per parameter of the whole model and of its quantized part, for the start-up log and
    /metrics: ``{"weight_bytes", "num_params", "bytes_per_param", "quantized": {"weight_bytes",
    "num_params", "bytes_per_param"}, "method"}`` (tied parameters counted once)."""
    plain_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    plain_numel = sum(p.numel() for p in model.parameters())
    qbytes, qnumel = quantized_bytes(model)
    method = getattr(model, "quant_method", None)
    total, numel = plain_bytes + qbytes, plain_numel + qnumel
    return {
        "weight_bytes": total,
        "num_params": numel,
        "bytes_per_param": total / max(numel, 1),
        "quantized": {"weight_bytes": qbytes, "num_params": qnumel, "bytes_per_param": qbytes / max(qnumel, 1)},
        "method": method.describe() if method is not None else None,
    }


def describe_report(report: dict) -> str:
    """One log line's worth: the quantized part, e.g. 'block FP8 (...): 120 layers' bytes 1.002 bytes/parameter'."""
    q = report["quantized"]
    if not q["num_params"]:
        return ""
    return (f"{report['method']}: {q['weight_bytes'] / 2**20:.1f} MiB for {q['num_params'] / 1e6:.1f}M quantized "
            f"parameters = {q['bytes_per_param']:.3f} bytes/parameter")
