"""Checks of a job's create request (400s with OpenAI's error body) and of its training file, line by line, as
OpenAI does: chat records ``{"messages": [...]}`` (also ``{"prompt", "completion"}``, which ``tokenfab finetune``
reads too). A bad line fails the job with ``error`` naming the line; nothing here raises anything but
``APIError`` or ``FileProblem``."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenfab.server.errors import APIError

ROLES = ("system", "developer", "user", "assistant", "tool")
SUFFIX_RE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
BOUNDS = {"n_epochs": (1, 50), "batch_size": (1, 256)}
MAX_LR_MULTIPLIER = 100.0
DEFAULT_EPOCHS, DEFAULT_BATCH = 3, 8
EXTRA_HYPERPARAMETERS = {"lora": bool, "lora_r": int, "lora_alpha": float}  # Nebius-style extensions


class FileProblem(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message, self.param = message, param


def _bad(message: str, param: str) -> APIError:
    return APIError(400, message, param=param, code="invalid_value" if "." in param else None)


def check_hyperparameters(hp: Any, param: str) -> dict[str, Any]:
    """The hyperparameters with "auto" kept as given; a 400 naming the bad one."""
    if hp is None:
        return {}
    if not isinstance(hp, dict):
        raise _bad(f"{param} must be an object", param)
    out: dict[str, Any] = {}
    for key, value in hp.items():
        where = f"{param}.{key}"
        if key in BOUNDS:
            lo, hi = BOUNDS[key]
            if value != "auto" and (type(value) is not int or not lo <= value <= hi):
                raise _bad(f"{where} must be \"auto\" or an integer in [{lo}, {hi}], got {value!r}", where)
        elif key == "learning_rate_multiplier":
            if value != "auto" and (type(value) not in (int, float) or not 0 < value <= MAX_LR_MULTIPLIER):
                raise _bad(f"{where} must be \"auto\" or a number in (0, {MAX_LR_MULTIPLIER:g}], got {value!r}",
                           where)
        elif key in EXTRA_HYPERPARAMETERS:
            kind = EXTRA_HYPERPARAMETERS[key]
            ok = type(value) is bool if kind is bool else (type(value) in (int, float) if kind is float
                                                            else type(value) is int)
            if not ok or (kind is not bool and not 0 < value <= 256):
                raise _bad(f"{where} must be a {kind.__name__}" + ("" if kind is bool else " in (0, 256]"), where)
        else:
            raise _bad(f"{where}: unknown hyperparameter (n_epochs, batch_size, learning_rate_multiplier, "
                       f"{', '.join(EXTRA_HYPERPARAMETERS)})", where)
        out[key] = value
    return out


def check_method(method: Any, legacy: Any) -> dict[str, Any]:
    """``method`` in OpenAI's shape with its hyperparameters checked; the legacy top-level ``hyperparameters``
    fill it when ``method`` is absent (both given: a 400, as OpenAI)."""
    if method is None:
        return {"type": "supervised", "supervised": {"hyperparameters": check_hyperparameters(legacy,
                                                                                              "hyperparameters")}}
    if legacy is not None:
        raise _bad("give the hyperparameters in method.supervised.hyperparameters or in the legacy top-level "
                   "hyperparameters, not both", "hyperparameters")
    if not isinstance(method, dict) or method.get("type") != "supervised":
        kind = method.get("type") if isinstance(method, dict) else method
        raise _bad(f"method.type must be \"supervised\" (the only method this server trains), got {kind!r}",
                   "method.type")
    unknown = set(method) - {"type", "supervised"}
    if unknown:
        raise _bad(f"method: unknown field {sorted(unknown)[0]!r}", "method")
    sup = method.get("supervised") or {}
    if not isinstance(sup, dict) or set(sup) - {"hyperparameters"}:
        raise _bad("method.supervised must be an object with only hyperparameters", "method.supervised")
    hp = check_hyperparameters(sup.get("hyperparameters"), "method.supervised.hyperparameters")
    return {"type": "supervised", "supervised": {"hyperparameters": hp}}


def check_suffix(suffix: Any) -> str | None:
    if suffix is None:
        return None
    if not isinstance(suffix, str) or not SUFFIX_RE.match(suffix):
        raise _bad("suffix must be 1 to 64 characters of letters, digits, '_', '.' or '-'", "suffix")
    return suffix


def resolve(hp: dict[str, Any], examples: int) -> dict[str, Any]:
    """The hyperparameters with "auto" and absent ones replaced by the values the job runs with."""
    out = dict(hp)
    if out.get("n_epochs", "auto") == "auto":
        out["n_epochs"] = DEFAULT_EPOCHS
    if out.get("batch_size", "auto") == "auto":
        out["batch_size"] = max(1, min(DEFAULT_BATCH, examples))
    if out.get("learning_rate_multiplier", "auto") == "auto":
        out["learning_rate_multiplier"] = 1.0
    return out


def _check_message(msg: Any, i: int) -> str | None:
    if not isinstance(msg, dict):
        return f"messages[{i}] is not an object"
    role = msg.get("role")
    if role not in ROLES:
        return f"messages[{i}] has an unknown role {role!r} (expected one of {', '.join(ROLES)})"
    content = msg.get("content")
    if content is not None and not isinstance(content, str):
        return f"messages[{i}].content must be a string"
    if role == "assistant":
        calls = msg.get("tool_calls")
        if calls is not None and (not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls)):
            return f"messages[{i}].tool_calls must be a list of objects"
        if not (content or "").strip() and not calls:
            return f"messages[{i}] is an assistant turn with no content and no tool_calls"
    elif content is None:
        return f"messages[{i}] ({role}) has no content"
    return None


def _check_record(record: Any) -> str | None:
    if not isinstance(record, dict):
        return "is not a JSON object"
    if "messages" in record:
        msgs = record["messages"]
        if not isinstance(msgs, list) or not msgs:
            return "'messages' must be a non-empty list"
        for i, msg in enumerate(msgs):
            problem = _check_message(msg, i)
            if problem:
                return problem
        if not any(m["role"] == "assistant" for m in msgs):
            return "has no assistant message to train on"
        return None
    if isinstance(record.get("prompt"), str) and isinstance(record.get("completion"), str) and record["completion"]:
        return None
    return "needs 'messages' (a chat) or a string 'prompt' and a non-empty 'completion'"


@dataclass
class CheckedFile:
    examples: int


def check_training_file(path: Path, param: str) -> CheckedFile:
    """Count the examples of a JSONL file; ``FileProblem`` naming the first bad line (1-based)."""
    examples = 0
    try:
        with open(path, "rb") as f:
            for n, raw in enumerate(f, 1):
                if not raw.strip():
                    continue
                try:
                    record = json.loads(raw)
                except (json.JSONDecodeError, UnicodeDecodeError) as e:
                    raise FileProblem(f"Invalid file format: line {n} is not valid JSON ({e})", param) from None
                problem = _check_record(record)
                if problem:
                    raise FileProblem(f"Invalid file format: line {n} {problem}" if problem.startswith(("is ", "has "))
                                      else f"Invalid file format: line {n}: {problem}", param)
                examples += 1
    except OSError as e:
        raise FileProblem(f"the file cannot be read: {e}", param) from None
    if examples == 0:
        raise FileProblem("the file holds no examples", param)
    return CheckedFile(examples)
