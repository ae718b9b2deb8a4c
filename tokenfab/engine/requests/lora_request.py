"""Which LoRA adapter a request runs with (vLLM's ``LoRARequest``): a name, an id and a path.

The id is what the engine keys everything by (its adapter caches, the prefix-cache root of the
request's blocks): a name unloaded and loaded again from another path gets a new id, so nothing
computed with the old weights is ever reused for the new ones.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class LoRARequest:
    lora_name: str
    lora_int_id: int  # >= 1; 0 is the base model
    lora_path: str
    base_model_name: str | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError("lora_path must be a non-empty string")

    def to_wire(self) -> list:
        """A plain list (msgpack, the engine-core process's IPC)."""
        return [self.lora_name, self.lora_int_id, self.lora_path, self.base_model_name]

    @classmethod
    def from_wire(cls, value: list | None) -> LoRARequest | None:
        if value is None:
            return None
        if not isinstance(value, (list, tuple)) or len(value) != 4:
            raise ValueError("lora_request must be [name, id, path, base_model_name]")
        return cls(*value)
