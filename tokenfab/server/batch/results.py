"""A batch's results as its lines finish: each result line appended (and flushed) to
``<data dir>/batches/<batch id>/output.jsonl`` or ``errors.jsonl`` before the line is marked done in the
database. The files are therefore the truth after a crash: ``reconcile`` drops a torn last line and returns the
custom_ids already answered, and the worker runs only the others. ``publish`` writes the final file in input
order, each custom_id once, and registers it in the file store (purpose ``batch_output``)."""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Any, BinaryIO

from tokenfab.server.batch.db import FileRow
from tokenfab.server.batch.files import FileStore


def result_line(custom_id: str, status: int, body: dict[str, Any]) -> dict[str, Any]:
    """OpenAI's output line: ``{id, custom_id, response: {status_code, request_id, body}, error}``."""
    line_id = "batch_req_" + secrets.token_hex(12)
    request_id = body.get("id") if isinstance(body.get("id"), str) else line_id
    return {"id": line_id, "custom_id": custom_id,
            "response": {"status_code": status, "request_id": request_id, "body": body}, "error": None}


USAGE_FIELDS = ("input_tokens", "cached_tokens", "output_tokens", "reasoning_tokens")


def usage_of(body: dict[str, Any]) -> dict[str, int]:
    """A response body's token usage in the batch's terms (chat/completions' names or the Responses API's)."""
    u = body.get("usage") if isinstance(body.get("usage"), dict) else {}
    inputs = u.get("prompt_tokens_details") or u.get("input_tokens_details") or {}
    outputs = u.get("completion_tokens_details") or u.get("output_tokens_details") or {}
    return {"input_tokens": int(u.get("prompt_tokens", u.get("input_tokens", 0)) or 0),
            "cached_tokens": int(inputs.get("cached_tokens", 0) or 0),
            "output_tokens": int(u.get("completion_tokens", u.get("output_tokens", 0)) or 0),
            "reasoning_tokens": int(outputs.get("reasoning_tokens", 0) or 0)}


def _complete_lines(path: Path) -> list[bytes]:
    """The file's whole lines; a torn last line (a crash mid-write) is cut off the file."""
    if not path.exists():
        return []
    data = path.read_bytes()
    cut = data.rfind(b"\n") + 1
    if cut < len(data):
        with open(path, "r+b") as f:
            f.truncate(cut)
    return [line for line in data[:cut].splitlines() if line.strip()]


class ResultFiles:
    def __init__(self, data_dir: Path, batch_id: str) -> None:
        self.dir = Path(data_dir) / "batches" / batch_id
        self.dir.mkdir(parents=True, exist_ok=True)
        self.paths = {False: self.dir / "output.jsonl", True: self.dir / "errors.jsonl"}
        self._open: dict[bool, BinaryIO] = {}

    def reconcile(self) -> tuple[dict[str, bool], dict[str, int]]:
        """custom_id -> failed for every line already written, and the usage they add up to (blocking)."""
        done: dict[str, bool] = {}
        usage = dict.fromkeys(USAGE_FIELDS, 0)
        for failed, path in self.paths.items():
            for raw in _complete_lines(path):
                line = json.loads(raw)
                if line["custom_id"] in done:
                    continue
                done[line["custom_id"]] = failed
                if not failed:
                    for k, v in usage_of(line["response"]["body"]).items():
                        usage[k] += v
        return done, usage

    def append(self, line: dict[str, Any], failed: bool) -> None:
        f = self._open.get(failed)
        if f is None:
            f = self._open[failed] = open(self.paths[failed], "ab")
        f.write(json.dumps(line, ensure_ascii=False).encode() + b"\n")
        f.flush()  # in the OS's hands: survives the process being killed

    def close(self) -> None:
        for f in self._open.values():
            os.fsync(f.fileno())
            f.close()
        self._open.clear()

    def publish(self, failed: bool, order: dict[str, int], store: FileStore, batch_id: str) -> FileRow | None:
        """The final output (or error) file in input order, each custom_id once, in the store (its row, for the
        caller to insert), or None if empty; blocking."""
        seen: dict[str, bytes] = {}
        for line in _complete_lines(self.paths[failed]):
            seen.setdefault(json.loads(line)["custom_id"], line)
        if not seen:
            return None
        tmp = self.dir / ("errors.final" if failed else "output.final")
        with open(tmp, "wb") as f:
            for custom_id in sorted(seen, key=lambda c: order.get(c, 0)):
                f.write(seen[custom_id] + b"\n")
            f.flush()
            os.fsync(f.fileno())
        name = f"{batch_id}_{'error' if failed else 'output'}.jsonl"
        return store.write(tmp, name, "batch_output")
