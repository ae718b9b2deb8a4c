"""The LoRA adapters a server serves by name (``--lora-modules``, ``/v1/load_lora_adapter``), vLLM's API.

A request picks one with ``model`` = its name; ``resolve`` turns the name into the ``LoRARequest`` the
engine runs with, which ``OpenAIServer.check_model`` keeps in a per-request context variable until
``submit`` hands it over (both run in the request's own task). Each load gets a fresh id (the engine
keys its caches and the prefix cache by it, so an adapter reloaded under the same name from other files
never meets the old one's KV); adapters given at start get ids derived from name and path, equal in
every API-server process.
"""

from __future__ import annotations

import contextvars
import hashlib
import json
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tokenfab.engine.requests.lora_request import LoRARequest
from tokenfab.loader.lora_adapter import WEIGHTS_NAME, check_adapter_files, read_adapter_config

#: the LoRA request of the API request being served (None: the base model)
REQUEST_LORA: contextvars.ContextVar[LoRARequest | None] = contextvars.ContextVar("tokenfab_lora", default=None)
MAX_NAME = 256


def parse_lora_module(spec: Any) -> tuple[str, str, str | None]:
    """(name, path, base_model_name) of a ``--lora-modules`` entry: ``name=path`` or the JSON form
    ``{"name": ..., "path": ..., "base_model_name": ...}`` (a string or an already parsed dict)."""
    if isinstance(spec, str) and spec.lstrip().startswith("{"):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"--lora-modules: not valid JSON: {e}") from None
    if isinstance(spec, dict):
        unknown = set(spec) - {"name", "path", "base_model_name"}
        if unknown or not isinstance(spec.get("name"), str) or not isinstance(spec.get("path"), str):
            raise ValueError('--lora-modules: a JSON entry is {"name": str, "path": str, "base_model_name": str}')
        base = spec.get("base_model_name")
        if base is not None and not isinstance(base, str):
            raise ValueError("--lora-modules: base_model_name must be a string")
        return spec["name"], spec["path"], base
    if isinstance(spec, str) and "=" in spec:
        name, _, path = spec.partition("=")
        if name and path:
            return name, path, None
    raise ValueError(f"--lora-modules: expected name=path or JSON, got {spec!r}")


@dataclass
class ServedAdapter:
    request: LoRARequest
    created: int = field(default_factory=lambda: int(time.time()))


class LoRARegistry:
    def __init__(self, enabled: bool, base_model: str, max_lora_rank: int | None, targets: dict | None = None) -> None:
        self.enabled = enabled
        self.targets = targets  # the engine's LoRA targets: adapter tensors are checked against them at load
        self.base_model = base_model
        self.max_lora_rank = max_lora_rank
        self.adapters: dict[str, ServedAdapter] = {}

    def check_adapter(self, name: Any, path: Any) -> None:
        """ValueError when (name, path) cannot be served (the name, the folder, its config, its rank)."""
        if not isinstance(name, str) or not name or len(name) > MAX_NAME or name.strip() != name:
            raise ValueError(f"lora_name must be a non-empty string of at most {MAX_NAME} characters without "
                             "surrounding spaces")
        if name == self.base_model:
            raise ValueError(f"lora_name {name!r} is the base model's name")
        if not isinstance(path, str) or not path or "\x00" in path:
            raise ValueError("lora_path must be a non-empty string")
        try:
            if self.targets is not None:
                check_adapter_files(path, self.targets, self.max_lora_rank)
            else:
                read_adapter_config(path, self.max_lora_rank)
        except FileNotFoundError as e:
            raise ValueError(f"lora_path: no adapter at {path!r} ({e})") from None
        if not (Path(path) / WEIGHTS_NAME).is_file():
            raise ValueError(f"lora_path: no {WEIGHTS_NAME} in {path!r}")

    def add(self, name: str, path: str, base_model_name: str | None = None, stable_id: bool = False) -> LoRARequest:
        if name in self.adapters:
            raise KeyError(name)
        self.check_adapter(name, path)
        if stable_id:  # the same in every API-server process
            lid = int.from_bytes(hashlib.blake2b(f"{name}\x00{path}".encode(), digest_size=8).digest(), "little")
        else:
            lid = secrets.randbits(62)
        req = LoRARequest(name, (lid >> 1) + 1, path, base_model_name or self.base_model)
        self.adapters[name] = ServedAdapter(req)
        return req

    def remove(self, name: str) -> LoRARequest:
        return self.adapters.pop(name).request

    def resolve(self, model: str) -> LoRARequest | None:
        served = self.adapters.get(model)
        return None if served is None else served.request

    def cards(self) -> list[dict[str, Any]]:
        return [{"id": name, "created": a.created, "root": a.request.lora_path, "parent": self.base_model}
                for name, a in self.adapters.items()]
