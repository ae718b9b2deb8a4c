"""Accelerator and interconnect figures for ``tokenfab plan`` (capacity planning on paper).

Every figure is a vendor datasheet peak, dense (no 2:4 sparsity), and is used as a roofline bound:
the plan's throughputs are upper limits, not predictions. Link bandwidths here are per direction
(NVIDIA quotes NVLink as the bidirectional total: 900 GB/s on H100/H200 = 450 GB/s each way; an
InfiniBand port of 400 Gb/s moves 50 GB/s each way).

Sources (as published by NVIDIA):
- H100 SXM5 80 GB: H100 Tensor Core GPU datasheet: 3.35 TB/s HBM3, BF16 989 TFLOPS, FP8 1979 TFLOPS
  (dense: half the "with sparsity" figures), NVLink 900 GB/s; DGX H100: 8 GPUs, 8x ConnectX-7 400 Gb/s.
- H200 SXM 141 GB: H200 datasheet: 4.8 TB/s HBM3e, same Tensor Cores as H100, NVLink 900 GB/s;
  HGX H200: 8 GPUs, one 400 Gb/s NIC per GPU.
- A100 SXM4 80 GB: A100 datasheet: 2039 GB/s HBM2e, BF16 312 TFLOPS, no FP8, NVLink 600 GB/s;
  DGX A100: 8 GPUs, 8x ConnectX-6 HDR 200 Gb/s.
- B200: HGX/DGX B200 datasheets: 180 GB HBM3e usable (1440 GB per 8), 8 TB/s, BF16 2.25 PFLOPS,
  FP8 4.5 PFLOPS dense (half the sparse 36 / 72 PFLOPS per 8 GPUs), NVLink 5 1.8 TB/s;
  DGX B200: 8x ConnectX-7 400 Gb/s.
- L40S: L40S datasheet: 48 GB GDDR6, 864 GB/s, BF16 362 TFLOPS, FP8 733 TFLOPS dense, PCIe Gen4 x16
  (64 GB/s bidirectional), no NVLink. No reference design fixes its network: the default of two
  200 Gb/s NICs per 8-GPU node is an assumption; pass ``--interconnect`` for the real one.

Memory is the total nvidia-smi reports on these boards (MiB), which the engine's
``--gpu-memory-utilization`` fraction applies to.

Latencies (one fixed cost per collective call) are rough assumptions, not datasheet figures:
5 us over NVLink, 10 us over PCIe, 15 us across nodes.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


class PlanInputError(ValueError):
    """A bad ``tokenfab plan`` input (unknown GPU, malformed interconnect or config)."""


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_mib: int          # device memory as nvidia-smi reports it (the datasheet "80 GB" is 81559 MiB)
    hbm_gbps: float          # GB/s memory bandwidth
    bf16_tflops: float       # dense matrix peak
    fp8_tflops: float | None  # dense FP8 matrix peak; None: no FP8 tensor cores
    gpus_per_node: int
    default_interconnect: str
    source: str

    @property
    def memory_bytes(self) -> float:
        return self.memory_mib * float(1 << 20)


GPUS: dict[str, GpuSpec] = {
    "h100": GpuSpec("H100 SXM5 80GB", 81559, 3350, 989, 1979, 8, "nvlink4,ib400", "H100 datasheet; DGX H100"),
    "h200": GpuSpec("H200 SXM 141GB", 143771, 4800, 989, 1979, 8, "nvlink4,ib400", "H200 datasheet; HGX H200"),
    "a100": GpuSpec("A100 SXM4 80GB", 81920, 2039, 312, None, 8, "nvlink3,ib200", "A100 datasheet; DGX A100"),
    "b200": GpuSpec("B200 180GB", 183359, 8000, 2250, 4500, 8, "nvlink5,ib400", "HGX/DGX B200 datasheets"),
    "l40s": GpuSpec("L40S 48GB", 46068, 864, 362, 733, 8, "pcie4,ib200x2", "L40S datasheet; network assumed"),
}

# intra-node links: (per-direction GB/s per GPU, latency in seconds)
_INTRA = {
    "nvlink3": (300.0, 5e-6), "nvlink4": (450.0, 5e-6), "nvlink5": (900.0, 5e-6),
    "pcie4": (32.0, 10e-6), "pcie5": (64.0, 10e-6),
}
_INTRA["nvlink"] = _INTRA["nvlink4"]
_INTER_LATENCY = 15e-6


@dataclass(frozen=True)
class Interconnect:
    """Bandwidth each GPU has to its node peers and across nodes, per direction."""
    intra_name: str
    intra_gbps: float
    intra_latency: float
    inter_name: str
    inter_gbps_per_gpu: float  # the node's NIC bandwidth shared by its GPUs
    inter_latency: float

    def describe(self) -> str:
        return (f"{self.intra_name} {self.intra_gbps:g} GB/s/dir intra-node, {self.inter_name} "
                f"{self.inter_gbps_per_gpu:g} GB/s/dir per GPU inter-node")


def get_gpu(name: str) -> GpuSpec:
    key = name.lower().replace("-", "").replace("_", "").split("sxm")[0].strip()
    if key not in GPUS:
        raise PlanInputError(f"unknown GPU {name!r}; known: {', '.join(sorted(GPUS))}")
    return GPUS[key]


def parse_interconnect(spec: str | None, gpu: GpuSpec) -> Interconnect:
    """``"nvlink,ib400"``: an intra-node link (nvlink3/4/5, nvlink = nvlink4, pcie4/5) and an inter-node
    fabric ``ib<Gb/s>`` or ``eth<Gb/s>``, optionally ``x<NICs per node>`` (default one NIC per GPU).
    Either part may be omitted; the GPU's usual one fills it in."""
    default_intra, default_inter = gpu.default_interconnect.split(",")
    intra, inter = default_intra, default_inter
    for part in (p.strip().lower() for p in (spec or "").split(",") if p.strip()):
        if part in _INTRA:
            intra = part
        elif re.fullmatch(r"(ib|eth)\d+(x\d+)?", part):
            inter = part
        else:
            raise PlanInputError(
                f"unknown interconnect {part!r}: use {'/'.join(sorted(_INTRA))} for the node and "
                "ib<Gb/s> or eth<Gb/s>[x<NICs per node>] across nodes, e.g. 'nvlink,ib400'")
    gbps, latency = _INTRA[intra]
    m = re.fullmatch(r"(ib|eth)(\d+)(?:x(\d+))?", inter)
    assert m is not None
    nics = int(m.group(3) or gpu.gpus_per_node)
    if int(m.group(2)) <= 0 or nics <= 0:
        raise PlanInputError(f"interconnect {inter!r}: bandwidth and NIC count must be positive")
    per_gpu = int(m.group(2)) / 8 * nics / gpu.gpus_per_node  # Gb/s -> GB/s, shared by the node's GPUs
    return Interconnect(intra, gbps, latency, inter, per_gpu, _INTER_LATENCY)
