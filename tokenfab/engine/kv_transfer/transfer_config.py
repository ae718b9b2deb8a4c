"""``--kv-transfer-config``: prefill/decode disaggregation, in vLLM's ``KVTransferConfig`` JSON shape.

``{"kv_connector": "NixlConnector", "kv_role": "kv_producer" | "kv_consumer" | "kv_both", "kv_rank": 0,
"kv_parallel_size": 2, "kv_ip": "127.0.0.1", "kv_port": 14579, "kv_buffer_size": 1e9,
"kv_connector_extra_config": {...}}``

- ``kv_connector``: the transport. ``NixlConnector`` (NIXL over UCX; on a machine without GPUs or RDMA UCX moves
  host memory over TCP) is the one implemented; vLLM's other names are refused with a clear message.
- ``kv_role``: a producer prefills and hands its prompt blocks over; a consumer takes them and decodes;
  ``kv_both`` does either, per request (the request's ``kv_transfer_params`` say which).
- ``kv_ip``/``kv_port``: where this instance's transfer agent listens (its NIXL side channel), and the address it
  advertises to the peer in ``kv_transfer_params`` (``remote_host``/``remote_port``). Each instance has its own.
  An IP address: NIXL does not resolve host names.
- ``kv_buffer_size``: bytes of host staging memory registered with the transport (vLLM's default 1e9): a producer
  keeps a finished prompt's blocks there until the consumer has read them, a consumer reads them into its own.
- ``kv_connector_extra_config``: ``transfer_timeout_s`` (default 10: a read not done by then is given up and the
  consumer prefills locally), ``pin_timeout_s`` (default 120: a producer frees staged blocks nobody read).

Unknown keys, wrong types and unknown values are start-up errors (``ValueError`` naming the key), never ignored.
"""

from __future__ import annotations

import ipaddress
import json
import uuid
from dataclasses import dataclass, field
from typing import Any

ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTORS = ("NixlConnector",)
# vLLM's other connectors: named so that a config written for vLLM gets a precise refusal
_VLLM_ONLY = ("P2pNcclConnector", "PyNcclConnector", "LMCacheConnectorV1", "MooncakeConnector", "MultiConnector",
              "OffloadingConnector", "SharedStorageConnector", "ExampleConnector", "DecodeBenchConnector")
_EXTRA_DEFAULTS: dict[str, float] = {"transfer_timeout_s": 10.0, "pin_timeout_s": 120.0}
# accepted for compatibility with vLLM configs, with the one value that means what we do
_FIXED = {"kv_buffer_device": ("cpu", "cuda"), "kv_load_failure_policy": ("recompute",)}


def _flag(what: str) -> str:
    return f"--kv-transfer-config: {what}"


@dataclass(frozen=True)
class KVTransferConfig:
    kv_connector: str
    kv_role: str
    kv_rank: int | None = None
    kv_parallel_size: int = 1
    kv_ip: str = "127.0.0.1"
    kv_port: int = 14579
    kv_buffer_size: float = 1e9
    engine_id: str = field(default_factory=lambda: str(uuid.uuid4()))
    kv_connector_extra_config: dict[str, Any] = field(default_factory=dict)

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def transfer_timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("transfer_timeout_s", _EXTRA_DEFAULTS["transfer_timeout_s"]))

    @property
    def pin_timeout_s(self) -> float:
        return float(self.kv_connector_extra_config.get("pin_timeout_s", _EXTRA_DEFAULTS["pin_timeout_s"]))

    @classmethod
    def parse(cls, value: str | dict | None) -> KVTransferConfig | None:
        """The config from its JSON text (or an already decoded dict); None when not given."""
        if value is None or value == "":
            return None
        if isinstance(value, str):
            try:
                raw = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(_flag(f"not valid JSON ({e.msg} at character {e.pos})")) from None
        else:
            raw = value
        if not isinstance(raw, dict):
            raise ValueError(_flag("must be a JSON object"))
        raw = dict(raw)
        known = {f for f in cls.__dataclass_fields__} | set(_FIXED) | {"kv_connector_module_path"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(_flag(f"unknown keys {unknown}; known: {sorted(known)}"))
        for key, allowed in _FIXED.items():
            v = raw.pop(key, allowed[0])
            if v not in allowed:
                raise ValueError(_flag(f"{key} must be one of {list(allowed)}, got {v!r}"))
        if raw.pop("kv_connector_module_path", None) is not None:
            raise ValueError(_flag("kv_connector_module_path (a connector loaded from your own module) is not "
                                   "supported"))
        connector = raw.get("kv_connector")
        if connector in _VLLM_ONLY:
            raise ValueError(_flag(f"kv_connector {connector!r} is vLLM's; tokenfab implements {list(CONNECTORS)}"))
        if connector not in CONNECTORS:
            raise ValueError(_flag(f"kv_connector must be one of {list(CONNECTORS)}, got {connector!r}"))
        if raw.get("kv_role") not in ROLES:
            raise ValueError(_flag(f"kv_role must be one of {list(ROLES)}, got {raw.get('kv_role')!r}"))
        _check_int(raw, "kv_rank", 0, 1 << 20, optional=True)
        _check_int(raw, "kv_parallel_size", 1, 1 << 20)
        _check_int(raw, "kv_port", 1, 65535)
        try:  # NIXL's side channel takes an address (inet_pton), not a host name
            ipaddress.ip_address(raw.get("kv_ip", "127.0.0.1"))
        except ValueError:
            raise ValueError(_flag(f"kv_ip must be an IP address, got {raw.get('kv_ip')!r}")) from None
        size = raw.get("kv_buffer_size", 1e9)
        if isinstance(size, bool) or not isinstance(size, (int, float)) or not 0 < size < 2**50:
            raise ValueError(_flag(f"kv_buffer_size must be a positive number of bytes, got {size!r}"))
        if "engine_id" in raw and (not isinstance(raw["engine_id"], str) or not raw["engine_id"]):
            raise ValueError(_flag(f"engine_id must be a non-empty string, got {raw['engine_id']!r}"))
        extra = raw.get("kv_connector_extra_config", {})
        if not isinstance(extra, dict):
            raise ValueError(_flag("kv_connector_extra_config must be an object"))
        bad = sorted(set(extra) - set(_EXTRA_DEFAULTS))
        if bad:
            raise ValueError(_flag(f"kv_connector_extra_config: unknown keys {bad}; known: {sorted(_EXTRA_DEFAULTS)}"))
        for k, v in extra.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v < 86400:
                raise ValueError(_flag(f"kv_connector_extra_config.{k} must be a positive number of seconds, "
                                       f"got {v!r}"))
        return cls(**raw)


def _check_int(raw: dict[str, Any], key: str, lo: int, hi: int, optional: bool = False) -> None:
    if key not in raw or (optional and raw[key] is None):
        return
    v = raw[key]
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise ValueError(_flag(f"{key} must be an integer in [{lo}, {hi}], got {v!r}"))
