"""Whole KV blocks copied out of and into a runner's cache tensors, as flat bytes.

The runner (``engine/runner/model_runner.py``) keeps one cache tensor per cache dtype: attention layers
``[num_layers, 2, num_blocks, block_size, Hkv, D]`` (block axis 2), latent-cache modules such as MLA
``[num_layers, num_blocks, block_size, *per-token shape]`` (block axis 1), per-layer paged caches (DeepSeek-V4)
``[num_blocks, *per-block shape]`` each (block axis 0). One block's payload is, per cache tensor in order,
every layer's slice of that block viewed as bytes, concatenated: a ``uint8`` row of ``block_nbytes``. The
copies work on byte views of the caches, so every cache dtype (float32, bfloat16, FP8 e4m3) round-trips bit
for bit. FP8 layers' k/v scales are per layer, not per block, and fixed once calibrated, so a block's bytes
are all a block needs (the tier lives and dies with one engine and its scales).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class BlockIO:
    def __init__(self, caches: Sequence[tuple[torch.Tensor, int]], num_blocks: int) -> None:
        """``caches``: (cache tensor, its block axis) pairs; each tensor contiguous with ``num_blocks`` on that axis."""
        if not caches:
            raise ValueError("no KV cache tensors to copy blocks of")
        self.num_blocks = num_blocks
        self._views: list[tuple[torch.Tensor, int, tuple[int, ...]]] = []  # (uint8 view, axis, one block's shape)
        for cache, axis in caches:
            if cache.shape[axis] != num_blocks or not cache.is_contiguous():
                raise ValueError(f"cache {tuple(cache.shape)} has not {num_blocks} blocks on axis {axis}, "
                                 "contiguous")
            view = cache.view(torch.uint8)  # last dim scaled by the item size; the block axis is unchanged
            block_shape = tuple(s for i, s in enumerate(view.shape) if i != axis)
            self._views.append((view, axis, block_shape))
        self.device = caches[0][0].device
        self.block_nbytes = sum(torch.Size(shape).numel() for _, _, shape in self._views)

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        if any(not 0 <= b < self.num_blocks for b in block_ids):
            raise IndexError(f"block ids out of range 0..{self.num_blocks - 1}: {list(block_ids)}")
        return torch.tensor(list(block_ids), dtype=torch.long, device=self.device)

    def read(self, block_ids: Sequence[int]) -> torch.Tensor:
        """The blocks' payloads: a CPU ``uint8`` tensor [len(block_ids), block_nbytes] (a copy)."""
        idx = self._index(block_ids)
        parts = [view.index_select(axis, idx).movedim(axis, 0).reshape(len(block_ids), -1)
                 for view, axis, _ in self._views]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return out.to("cpu", copy=True)

    def write(self, block_ids: Sequence[int], payload: torch.Tensor) -> None:
        """Overwrite device blocks ``block_ids`` with ``payload`` rows (``uint8`` [len(block_ids), block_nbytes])."""
        n = len(block_ids)
        if payload.dtype != torch.uint8 or tuple(payload.shape) != (n, self.block_nbytes):
            raise ValueError(f"payload must be uint8 [{n}, {self.block_nbytes}], got {payload.dtype} "
                             f"{tuple(payload.shape)}")
        if n == 0:
            return
        idx = self._index(block_ids)
        src = payload.to(self.device)
        per_block = self.device.type == "cpu"  # see below
        offset = 0
        for view, axis, block_shape in self._views:
            size = torch.Size(block_shape).numel()
            if per_block:  # one copy of contiguous runs per block: on a CPU, index_copy_ over a uint8 view goes
                # byte by byte (~6x slower), and a P/D consumer pays this on its engine thread between decode steps
                for row, b in zip(src[:, offset:offset + size], block_ids):
                    view.select(axis, b).copy_(row.view(block_shape))
            else:  # one kernel for all the blocks
                view.index_copy_(axis, idx, src[:, offset:offset + size].reshape(n, *block_shape).movedim(0, axis))
            offset += size
