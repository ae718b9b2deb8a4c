"""The wire protocol between the API server process(es) and the engine-core process.

Every frame is one msgpack array ``[VERSION, TAG, *fields]`` (never pickle: a frame is data, and
decoding one runs no code). Token ids cross the boundary, never text. ``decode`` checks the
version, the tag and the type of every field, and raises ``ProtocolError`` on anything else, so a
malformed or foreign frame is rejected before it reaches the engine.

Messages (front end -> core): ``hello`` (a front end connects), ``add`` (one engine request: id,
prompt token ids, SamplingParams as a plain dict, priority, cache salt, structured-output spec as
JSON text or None), ``abort`` (request ids), ``shutdown``.
Messages (core -> front end): ``ready`` (model info), ``outputs`` (a list of per-request outputs and
the engine's stats), ``dead`` (the core hit a fatal error and exits).

A per-request output is ``[id, new_token_ids, logprobs, finish_reason, stop_reason, error,
num_cached_tokens, prompt_logprobs, kv_transfer_params]`` (the last may be left out: None; prefill/decode
disaggregation); ``logprobs`` holds one ``[ids, logprobs, ranks]`` triple of parallel arrays per new token
(``None`` when not asked for), ``prompt_logprobs`` one triple per prompt position (first ``None``), sent once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from tokenfab.engine.requests.sampling_params import SamplingParams

VERSION = 1
MAX_FRAME_BYTES = 256 << 20


class ProtocolError(ValueError):
    """A frame that is not a valid message of this protocol version."""


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return (isinstance(x, (int, float)) and not isinstance(x, bool))


def _opt(check: Any) -> Any:
    return lambda x: x is None or check(x)


def _int_list(x: Any) -> bool:
    return isinstance(x, list) and all(_is_int(t) for t in x)


def _str(x: Any) -> bool:
    return isinstance(x, str)


def _triple(x: Any) -> bool:
    return (isinstance(x, list) and len(x) == 3 and _int_list(x[0]) and _int_list(x[2])
            and isinstance(x[1], list) and all(_is_num(v) for v in x[1]) and len(x[0]) == len(x[1]) == len(x[2]))


def _triples(x: Any) -> bool:
    return isinstance(x, list) and all(_triple(t) for t in x)


def _output(x: Any) -> bool:
    return (isinstance(x, list) and len(x) in (8, 9) and _str(x[0]) and _int_list(x[1]) and _opt(_triples)(x[2])
            and _opt(_str)(x[3]) and (x[4] is None or _str(x[4]) or _is_int(x[4])) and _opt(_str)(x[5])
            and _is_int(x[6]) and (x[7] is None or (isinstance(x[7], list)
                                                    and all(t is None or _triple(t) for t in x[7])))
            and (len(x) == 8 or x[8] is None or isinstance(x[8], dict)))


# tag -> the checks of its fields, in order
SCHEMA: dict[str, tuple[Any, ...]] = {
    "hello": (),
    # ..., arrival time, LoRA request as [name, id, path, base] (multi-LoRA) or None
    "add": (_str, _int_list, lambda x: isinstance(x, dict), _is_int, _opt(_str), _opt(_str), _is_num,
            _opt(lambda x: isinstance(x, list))),
    "abort": (lambda x: isinstance(x, list) and all(_str(t) for t in x),),
    "shutdown": (),
    "ready": (lambda x: isinstance(x, dict),),
    "outputs": (lambda x: isinstance(x, list) and all(_output(o) for o in x), _opt(lambda x: isinstance(x, dict))),
    "dead": (_str,),
}


def encode(tag: str, *fields: Any) -> bytes:
    if tag not in SCHEMA:
        raise ProtocolError(f"unknown message type {tag!r}")
    return msgpack.packb([VERSION, tag, *fields], use_bin_type=True)


def decode(frame: bytes) -> tuple[str, list[Any]]:
    """``(tag, fields)`` of a valid frame; ``ProtocolError`` for anything else."""
    if not isinstance(frame, (bytes, bytearray, memoryview)) or len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError("frame is not bytes or is too large")
    try:
        msg = msgpack.unpackb(frame, raw=False, strict_map_key=True, use_list=True)
    except Exception as e:  # msgpack's ExtraData, FormatError, ValueError, UnicodeDecodeError...
        raise ProtocolError(f"not a msgpack frame: {e}") from None
    if not isinstance(msg, list) or len(msg) < 2:
        raise ProtocolError("a frame is an array [version, type, ...]")
    version, tag, fields = msg[0], msg[1], msg[2:]
    if version != VERSION or not _is_int(version):
        raise ProtocolError(f"protocol version {version!r} is not {VERSION}")
    checks = SCHEMA.get(tag) if isinstance(tag, str) else None
    if checks is None:
        raise ProtocolError(f"unknown message type {tag!r}")
    if len(fields) != len(checks):
        raise ProtocolError(f"{tag}: expected {len(checks)} fields, got {len(fields)}")
    for i, (check, value) in enumerate(zip(checks, fields)):
        if not check(value):
            raise ProtocolError(f"{tag}: field {i} is malformed")
    return tag, fields


# ---- sampling parameters ----------------------------------------------------------------------
_PARAM_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name != "constraint")


def params_to_wire(p: SamplingParams) -> dict[str, Any]:
    """The parameters as a plain dict (logit_bias as [id, bias] pairs; the constraint travels as its spec)."""
    d = {name: getattr(p, name) for name in _PARAM_FIELDS}
    if d["logit_bias"] is not None:
        d["logit_bias"] = [[int(k), float(v)] for k, v in d["logit_bias"].items()]
    return d


def params_from_wire(d: dict[str, Any]) -> SamplingParams:
    """SamplingParams from ``params_to_wire``'s dict; ValueError (naming the field) if it is not one."""
    unknown = set(d) - set(_PARAM_FIELDS)
    if unknown:
        raise ValueError(f"unknown sampling parameters {sorted(unknown)}")
    d = dict(d)
    bias = d.get("logit_bias")
    if bias is not None:
        if not isinstance(bias, list) or not all(isinstance(x, list) and len(x) == 2 for x in bias):
            raise ValueError("logit_bias must be [token id, bias] pairs")
        d["logit_bias"] = {k: v for k, v in bias}
    for name in ("stop", "stop_token_ids"):
        if d.get(name) is not None and not isinstance(d[name], list):
            raise ValueError(f"{name} must be a list")
    return SamplingParams(**d)
