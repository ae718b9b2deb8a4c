"""vLLM's ``kv_transfer_params`` of a request, checked (they come from a client). Light on purpose: every engine
checks parameters, only PD instances load NIXL."""

from __future__ import annotations

from typing import Any

#: the parameters a producer's answer carries, with their types (checked on the consumer: they come from a client)
_REMOTE_FIELDS: dict[str, type | tuple[type, ...]] = {
    "remote_engine_id": str, "remote_host": str, "remote_port": int, "remote_block_ids": list,
    "remote_block_hashes": list, "remote_buffer": list,
}


def check_params(params: Any) -> dict[str, Any] | None:
    """``kv_transfer_params`` of a request, checked (ValueError naming the field); None when absent."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be an object")
    for key in ("do_remote_prefill", "do_remote_decode"):
        if not isinstance(params.get(key, False), bool):
            raise ValueError(f"kv_transfer_params.{key} must be a boolean")
    if params.get("do_remote_prefill"):
        for key, kind in _REMOTE_FIELDS.items():
            v = params.get(key)
            if not isinstance(v, kind) or isinstance(v, bool):
                raise ValueError(f"kv_transfer_params.{key} is missing or not a {kind.__name__}")
        ids, hashes, buf = params["remote_block_ids"], params["remote_block_hashes"], params["remote_buffer"]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
            raise ValueError("kv_transfer_params.remote_block_ids must be non-negative integers")
        if len(hashes) != len(ids) or not all(isinstance(h, str) and len(h) == 32 for h in hashes):
            raise ValueError("kv_transfer_params.remote_block_hashes must be one 32-digit hex digest per block")
        try:
            [bytes.fromhex(h) for h in hashes]
        except ValueError:
            raise ValueError("kv_transfer_params.remote_block_hashes must be hex digests") from None
        if len(buf) != 2 or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in buf):
            raise ValueError("kv_transfer_params.remote_buffer must be [address, bytes per block]")
    return params
