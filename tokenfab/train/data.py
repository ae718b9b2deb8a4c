"""Fine-tuning data: JSONL records -> token ids with loss labels -> packed batches.

A record is either a chat (``{"messages": [...]}``: the loss is on every assistant turn, tool calls and
``tool`` messages allowed, rendered by the tokenizer's chat template) or ``{"prompt": ..., "completion": ...}``
(the loss is on the completion and the end-of-sequence token).

Assistant spans are found in the rendered text, not by guessing token patterns: either from the template's
own ``{% generation %}`` marks (``return_assistant_tokens_mask``) or by rendering the conversation prefix by
prefix (the text up to the assistant's generation prompt, then up to the end of its turn) and labelling the
tokens whose characters start inside each span. Packing puts several samples into one row with positions that
restart at 0 per sample and ``cu_seqlens`` marking the boundaries; labels stay unshifted (like Hugging Face),
and the first label of every sample is -100, so a shift inside the row can never train a sample's last token to
predict the next sample's first one.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

IGNORE_INDEX = -100
ROLES = ("system", "user", "assistant", "tool")


class DataError(ValueError):
    """A malformed training record; the message names the file and line."""


def _fail(where: str, msg: str) -> DataError:
    return DataError(f"{where}: {msg}")


def _check_message(msg: Any, where: str, i: int) -> None:
    if not isinstance(msg, dict):
        raise _fail(where, f"messages[{i}] must be an object, got {type(msg).__name__}")
    role = msg.get("role")
    if role not in ROLES:
        raise _fail(where, f"messages[{i}] has unknown role {role!r} (expected one of {', '.join(ROLES)})")
    content = msg.get("content")
    if content is not None and not isinstance(content, str):
        raise _fail(where, f"messages[{i}].content must be a string")
    if role == "assistant":
        calls = msg.get("tool_calls")
        if calls is not None and (not isinstance(calls, list) or not all(isinstance(c, dict) for c in calls)):
            raise _fail(where, f"messages[{i}].tool_calls must be a list of objects")
        if not (content or "").strip() and not calls:
            raise _fail(where, f"messages[{i}] is an empty assistant turn (no content and no tool_calls)")
    elif content is None:
        raise _fail(where, f"messages[{i}] ({role}) has no content")


def validate_record(record: Any, where: str) -> dict:
    """Check one record's shape; raise :class:`DataError` naming ``where`` (``file:line``) if it is bad."""
    if not isinstance(record, dict):
        raise _fail(where, f"a record must be a JSON object, got {type(record).__name__}")
    if "messages" in record:
        msgs = record["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise _fail(where, "'messages' must be a non-empty list")
        for i, msg in enumerate(msgs):
            _check_message(msg, where, i)
        if not any(m["role"] == "assistant" for m in msgs):
            raise _fail(where, "the conversation has no assistant turn to train on")
        return record
    if "prompt" in record or "completion" in record:
        for key in ("prompt", "completion"):
            if not isinstance(record.get(key), str):
                raise _fail(where, f"'{key}' is missing or not a string")
        if not record["completion"]:
            raise _fail(where, "'completion' is empty")
        return record
    raise _fail(where, "a record needs 'messages' or 'prompt' + 'completion'")


def load_records(path: str | Path) -> list[dict]:
    """Read a JSONL file of records (blank lines skipped); errors name the file and line."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    records = []
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise _fail(where, f"invalid JSON ({e.msg} at column {e.colno})") from None
            records.append(validate_record(record, where))
    if not records:
        raise DataError(f"{path}: no records")
    return records


def _render(tokenizer: Any, messages: list[dict], tools: Any, generation_prompt: bool) -> str:
    extra = {"tools": tools} if tools else {}
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt, **extra)


def _assistant_char_spans(tokenizer: Any, messages: list[dict], tools: Any) -> tuple[str, list[tuple[int, int]]]:
    """The full rendered text and the character span of each assistant turn (its end-of-turn marker included)."""
    full = _render(tokenizer, messages, tools, False)
    spans = []
    for i, msg in enumerate(messages):
        if msg["role"] != "assistant":
            continue
        before = _render(tokenizer, messages[:i], tools, True) if i else ""
        through = _render(tokenizer, messages[: i + 1], tools, False)
        if not full.startswith(through) or not through.startswith(before) or len(through) <= len(before):
            raise DataError(
                "the chat template does not render the conversation prefix by prefix (an earlier turn renders "
                "differently once later turns follow), so the assistant spans cannot be located; use a template "
                "with {% generation %} marks"
            )
        spans.append((len(before), len(through)))
    return full, spans


def _label(ids: list[int], mask: list[bool]) -> list[int]:
    return [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]


def _tokenize_chat(tokenizer: Any, record: dict) -> tuple[list[int], list[int]]:
    messages, tools = record["messages"], record.get("tools")
    template = getattr(tokenizer, "chat_template", None) or ""
    if "{% generation %}" in template or "{%- generation %}" in template:
        out = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True,
            **({"tools": tools} if tools else {}),
        )
        ids = list(out["input_ids"])
        return ids, _label(ids, [bool(m) for m in out["assistant_masks"]])
    text, spans = _assistant_char_spans(tokenizer, messages, tools)
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(enc["input_ids"])
    starts = [s for s, _ in enc["offset_mapping"]]
    mask = [any(a <= s < b for a, b in spans) for s in starts]
    return ids, _label(ids, mask)


def _tokenize_completion(tokenizer: Any, record: dict) -> tuple[list[int], list[int]]:
    prompt = tokenizer(record["prompt"], add_special_tokens=True)["input_ids"] if record["prompt"] else []
    completion = tokenizer(record["completion"], add_special_tokens=False)["input_ids"]
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    ids = list(prompt) + list(completion) + eos
    return ids, [IGNORE_INDEX] * len(prompt) + list(completion) + eos


def tokenize_record(tokenizer: Any, record: dict, max_len: int) -> tuple[list[int], list[int]]:
    """Token ids and unshifted labels (-100 outside the trained span), truncated to ``max_len`` tokens."""
    if max_len < 2:
        raise ValueError(f"max_len must be at least 2, got {max_len}")
    if "messages" in record:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError("chat records need a tokenizer with a chat template")
        ids, labels = _tokenize_chat(tokenizer, record)
    else:
        ids, labels = _tokenize_completion(tokenizer, record)
    return ids[:max_len], labels[:max_len]


@dataclass
class PackedBatch:
    """One packed row: samples laid end to end, attention to be kept inside each ``cu_seqlens`` segment."""

    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long, restarting at 0 per sample
    labels: torch.Tensor  # [1, T] long, unshifted; -100 where no loss (and at every sample's first token)
    cu_seqlens: torch.Tensor  # [n + 1] int32
    num_loss_tokens: int  # tokens that contribute to the loss after the shift

    @property
    def num_samples(self) -> int:
        return int(self.cu_seqlens.numel()) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[1])

    def to(self, device: torch.device | str) -> PackedBatch:
        return PackedBatch(self.input_ids.to(device), self.position_ids.to(device), self.labels.to(device),
                           self.cu_seqlens.to(device), self.num_loss_tokens)


def _build(samples: list[tuple[list[int], list[int]]]) -> PackedBatch:
    lengths = [len(ids) for ids, _ in samples]
    ids = torch.tensor([t for s, _ in samples for t in s], dtype=torch.long)
    labels = torch.tensor([t for _, lab in samples for t in lab], dtype=torch.long)
    cu = torch.zeros(len(samples) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(torch.tensor(lengths, dtype=torch.int32), 0)
    labels[cu[:-1].long()] = IGNORE_INDEX  # nothing inside a sample predicts its first token
    positions = torch.arange(ids.numel()) - torch.repeat_interleave(cu[:-1].long(), torch.tensor(lengths))
    n_loss = int((labels != IGNORE_INDEX).sum())
    return PackedBatch(ids[None], positions[None], labels[None], cu, n_loss)


def pack(examples: list[tuple[list[int], list[int]]], max_tokens: int,
         max_samples: int | None = None) -> list[PackedBatch]:
    """First-fit packing of ``(input_ids, labels)`` examples into rows of at most ``max_tokens`` tokens
    (and at most ``max_samples`` samples, when given). Deterministic: examples go, in order, into the first
    row with room; rows keep the order in which they were opened."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be positive, got {max_tokens}")
    rows: list[list[tuple[list[int], list[int]]]] = []
    room: list[int] = []
    for k, (ids, labels) in enumerate(examples):
        if len(ids) != len(labels):
            raise ValueError(f"example {k}: {len(ids)} input ids but {len(labels)} labels")
        if not ids:
            raise ValueError(f"example {k} is empty")
        if len(ids) > max_tokens:
            raise ValueError(f"example {k} has {len(ids)} tokens, more than max_tokens={max_tokens} "
                             "(truncate with tokenize_record's max_len)")
        for r, free in enumerate(room):
            if free >= len(ids) and (max_samples is None or len(rows[r]) < max_samples):
                rows[r].append((ids, labels))
                room[r] -= len(ids)
                break
        else:
            rows.append([(ids, labels)])
            room.append(max_tokens - len(ids))
    return [_build(r) for r in rows]
