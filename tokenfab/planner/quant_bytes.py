"""Bytes a weight takes on the GPU under a checkpoint's ``quantization_config`` (packed values + scales),
as the formats are laid out on disk and kept packed in memory:

- ``fp8`` (block FP8, DeepSeek/Qwen3 FP8): 1 byte a value + a float32 ``weight_scale_inv`` per
  ``weight_block_size`` block (edge blocks count whole), or one per tensor without a block size.
- ``compressed-tensors``: ``pack-quantized`` INT-n (``num_bits``/8 bytes a value, a bf16 scale per
  group, ``weight_shape``) and ``float-quantized`` FP8 (per-channel/tensor/block float32 scales); the
  ``ignore`` list (names or ``re:`` regexes) keeps modules in the model dtype.
- ``mxfp4`` (GPT-OSS): e2m1 codes, two a byte, + one e8m0 scale byte per 32; ``modules_to_not_convert``.
- ``modelopt`` NVFP4 (ModelOpt, ``hf_quant_config.json``): two e2m1 a byte + an e4m3 scale per 16 +
  float32 ``weight_scale_2`` and ``input_scale``; ModelOpt FP8: 1 byte a value + two float32 scales.

Routers, norms, embeddings and the LM head stay in the model dtype in every format (as the official
releases ship them). ``compute`` says which matrix peak the quantized GEMMs run at: W8A8 formats at
the FP8 peak, the 4-bit ones as W4A16 at the bf16 peak (tokenfab's kernels; Hopper has no FP4 cores).
"""

from __future__ import annotations

import fnmatch
import math
import re
from dataclasses import dataclass, field
from typing import Any

from tokenfab.planner.hardware import PlanInputError
from tokenfab.planner.spec_types import Weight

SUPPORTED = ("fp8", "compressed-tensors", "mxfp4", "modelopt")


@dataclass(frozen=True)
class QuantScheme:
    method: str = "none"            # none | fp8_block | fp8_tensor | fp8_channel | int | mxfp4 | nvfp4
    bits: int = 16
    group: int = 0                  # values per scale along K (int / nvfp4 / mxfp4)
    block: tuple[int, int] = (0, 0)  # fp8_block: (rows, cols) per scale
    ignore: tuple[str, ...] = ()
    targets: tuple[str, ...] = field(default=("Linear",))
    compute: str = "bf16"           # "fp8": W8A8 GEMMs run at the FP8 peak
    experts: bool = True            # False: the routed experts stay in the model dtype (online FP8)

    def applies(self, w: Weight) -> bool:
        if self.method == "none" or not (w.linear and w.quantizable) or (w.experts > 1 and not self.experts):
            return False
        module = w.name.removesuffix(".weight")
        if any(_matches(p, module) for p in self.ignore):
            return False
        return any(t == "Linear" or _matches(t, module) for t in self.targets)

    def bytes_per_matrix(self, rows: int, cols: int) -> float:
        """Bytes of one rows x cols matrix in this format (the caller checked ``applies``)."""
        n = rows * cols
        if self.method == "fp8_block":
            br, bc = self.block
            return n + math.ceil(rows / br) * math.ceil(cols / bc) * 4
        if self.method == "fp8_tensor":
            return n + 8
        if self.method == "fp8_channel":
            return n + rows * 4
        if self.method == "int":
            return n * self.bits / 8 + rows * math.ceil(cols / self.group) * 2 + 8
        if self.method == "mxfp4":
            return n / 2 + rows * math.ceil(cols / 32)
        if self.method == "nvfp4":
            return n / 2 + rows * math.ceil(cols / 16) + 8
        raise AssertionError(self.method)


ONLINE = ("fp8", "fp8-block")


def online_scheme(quantization: str, checkpoint: QuantScheme) -> QuantScheme:
    """``--quantization fp8`` / ``fp8-block`` of a 16-bit checkpoint, as the engine's online path does it
    (``quant/online.py``): Linear layers to FP8 with a float32 scale per output row (``fp8``) or per
    128x128 block (``fp8-block``), W8A8. The routed experts are not Linear layers there: they stay in
    16 bits (2 bytes a value), and TP may split them like any unquantized experts."""
    if quantization not in ONLINE:
        raise PlanInputError(f"--quantization {quantization!r}: only {' / '.join(map(repr, ONLINE))} (online) "
                             "are planned")
    if checkpoint.method != "none":
        raise PlanInputError(f"--quantization {quantization}: the checkpoint is already quantized")
    if quantization == "fp8":
        return QuantScheme("fp8_channel", 8, compute="fp8", experts=False)
    return QuantScheme("fp8_block", 8, block=(128, 128), compute="fp8", experts=False)


def _matches(pattern: str, module: str) -> bool:
    """A module name matches a pattern given as ``re:<regex>`` (matched from the start), a glob with
    ``*``, or a dotted name equal to the module or to one of its trailing component runs."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    if "*" in pattern:
        return fnmatch.fnmatchcase(module, pattern) or fnmatch.fnmatchcase(module, pattern + ".*")
    return module == pattern or module.endswith("." + pattern) or module.startswith(pattern + ".")


def _strs(v: Any, key: str) -> tuple[str, ...]:
    if v is None:
        return ()
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise PlanInputError(f"quantization_config: {key!r} must be a list of strings")
    return tuple(v)


def parse_quantization(q: dict[str, Any] | None) -> QuantScheme:
    """The scheme of a ``quantization_config`` (None: unquantized). Unknown methods: a clear error."""
    if not q:
        return QuantScheme()
    method = q.get("quant_method")
    if method == "fp8":
        block = q.get("weight_block_size")
        ignore = _strs(q.get("modules_to_not_convert"), "modules_to_not_convert")
        if block is None:
            return QuantScheme("fp8_tensor", 8, ignore=ignore, compute="fp8")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise PlanInputError(f"quantization_config: weight_block_size must be two positive ints, got {block!r}")
        return QuantScheme("fp8_block", 8, block=(block[0], block[1]), ignore=ignore, compute="fp8")
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method == "mxfp4":
        return QuantScheme("mxfp4", 4, 32, ignore=_strs(q.get("modules_to_not_convert"), "modules_to_not_convert"))
    if method == "modelopt":
        algo = str(q.get("quant_algo", "")).upper()
        ignore = _strs(q.get("exclude_modules") or q.get("ignore"), "exclude_modules")
        if algo == "NVFP4":
            return QuantScheme("nvfp4", 4, int(q.get("group_size") or 16), ignore=ignore)
        if algo == "FP8":
            return QuantScheme("fp8_tensor", 8, ignore=ignore, compute="fp8")
        raise PlanInputError(f"quantization_config: ModelOpt quant_algo {algo!r} is not supported (NVFP4, FP8)")
    raise PlanInputError(f"quantization_config: quant_method {method!r} is not supported; "
                         f"supported: {', '.join(SUPPORTED)}")


def _compressed_tensors(q: dict[str, Any]) -> QuantScheme:
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise PlanInputError("quantization_config: compressed-tensors needs config_groups")
    if len(groups) > 1:
        raise PlanInputError("quantization_config: more than one compressed-tensors config group is not supported")
    group = next(iter(groups.values()))
    wq = group.get("weights") if isinstance(group, dict) else None
    if not isinstance(wq, dict):
        raise PlanInputError("quantization_config: the config group has no 'weights' scheme")
    bits, kind, strategy = wq.get("num_bits"), wq.get("type"), wq.get("strategy")
    ignore, targets = _strs(q.get("ignore"), "ignore"), _strs(group.get("targets"), "targets") or ("Linear",)
    act = group.get("input_activations")
    if kind == "int" and bits in (4, 8) and strategy in ("group", "channel"):
        size = wq.get("group_size") if strategy == "group" else None
        if strategy == "group" and not (isinstance(size, int) and size > 0):
            raise PlanInputError("quantization_config: group strategy needs a positive group_size")
        return QuantScheme("int", bits, size or 1 << 30, ignore=ignore, targets=targets,
                           compute="fp8" if bits == 8 and act else "bf16")
    if kind == "float" and bits == 8:
        compute = "fp8" if act else "bf16"
        if strategy == "channel":
            return QuantScheme("fp8_channel", 8, ignore=ignore, targets=targets, compute=compute)
        if strategy == "tensor":
            return QuantScheme("fp8_tensor", 8, ignore=ignore, targets=targets, compute=compute)
        if strategy == "block":
            b = wq.get("block_structure") or [128, 128]
            return QuantScheme("fp8_block", 8, block=(int(b[0]), int(b[1])), ignore=ignore, targets=targets,
                               compute=compute)
    raise PlanInputError(f"quantization_config: compressed-tensors scheme {kind}{bits} / {strategy} is not supported")
