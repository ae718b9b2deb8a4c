"""The paged KV cache of a model-based proposer (a draft model, an EAGLE-3 head, an MTP layer).

Its draft ``module`` runs through a ``ModelRunner`` of its own, over a cache indexed by the target's
block tables (``speculative/draft_batch.py``); the engine sizes that cache with the target's
(``kv_bytes_per_token``) and then binds it (``bind_cache``). A module that keeps state per sequence gets
one row per target state slot (the draft batches carry the target's ``state_slots``)."""

from __future__ import annotations

from torch import nn

from tokenfab.engine.runner.model_runner import ModelRunner, kv_bytes_per_token
from tokenfab.engine.runner.state_cache import has_recurrent_state
from tokenfab.speculative.target import TargetEngine


class OwnCacheDraft:
    """Base of the model-based proposers: ``module`` and ``engine`` are set by the subclass."""

    model_based = True
    module: nn.Module
    engine: TargetEngine
    runner: ModelRunner | None = None

    def kv_bytes_per_token(self) -> int:
        return kv_bytes_per_token(self.module, self.engine.dtype)

    def bind_cache(self, block_size: int, num_blocks: int) -> None:
        # a module with per-sequence state (DeepSeek-V4's MTP layer: its ring) uses the target's state slots
        slots = getattr(self.engine, "num_state_slots", 0) if has_recurrent_state(self.module) else 0
        self.runner = ModelRunner(self.module, self.engine.device, self.engine.dtype, block_size, num_blocks, slots)
