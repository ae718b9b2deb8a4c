"""Schemathesis over the server's own OpenAPI document, bounded: every operation, schema-valid
(positive) and schema-violating (negative) requests, each response checked for: no 5xx, an OpenAI
error body on every 4xx, and schemathesis' conformance checks (status code documented, content
type documented, body valid against the documented schema, negative data rejected, ...).

Not checked: ``positive_data_acceptance`` — a schema-valid request can still be one the model
cannot serve (a prompt longer than its context, a token id outside its vocabulary, another model's
name, min_tokens above max_tokens), and those are 400s by design.

Used by the tests (in process over the fake engine; live over the bundled model) and by
``scripts/fuzz_server.py``.
"""

from __future__ import annotations

import collections
import json
import time
from dataclasses import dataclass, field
from typing import Any

ERROR_KEYS = {"message", "type", "param", "code"}


@dataclass
class FuzzReport:
    requests: int = 0
    statuses: collections.Counter = field(default_factory=collections.Counter)
    by_operation: dict[str, collections.Counter] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def server_errors(self) -> int:
        return sum(n for s, n in self.statuses.items() if s >= 500)

    def as_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "statuses": {str(k): v for k, v in sorted(self.statuses.items())},
                "server_errors": self.server_errors, "failures": self.failures[:20],
                "by_operation": {op: {str(k): v for k, v in sorted(c.items())} for op, c in self.by_operation.items()},
                "seconds": round(self.seconds, 1)}


def _check_error_body(resp: Any) -> str | None:
    if not 400 <= resp.status_code < 500:
        return None
    try:
        body = json.loads(resp.content)
    except ValueError:
        return f"{resp.status_code} without a JSON body: {resp.content[:200]!r}"
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict) or set(err) != ERROR_KEYS or not err.get("message"):
        return f"{resp.status_code} without OpenAI's error body: {body!r:.300}"
    return None


def _check_stream(resp: Any) -> str | None:
    """A 200 event stream must end with [DONE] and carry no in-band error (a hidden 5xx)."""
    if resp.status_code != 200 or "text/event-stream" not in resp.headers.get("content-type", ""):
        return None
    text = resp.content.decode("utf-8")
    lines = [line[6:] for line in text.splitlines() if line.startswith("data: ")]
    if not lines or lines[-1] != "[DONE]":
        return "event stream does not end with [DONE]"
    if any('"error"' in line and json.loads(line).get("error") for line in lines[:-1]):
        return f"error event inside a 200 stream: {text[-300:]!r}"
    return None


_LIMITS = ("max_tokens", "max_completion_tokens", "max_output_tokens")
_GENERATING = ("/v1/completions", "/v1/chat/completions", "/v1/responses")


def _cap_generation(body: Any, cap: int, path: str) -> Any:
    """Keep a schema-valid body's generation short (a live model at 2**31 max_tokens, or with no limit,
    would run to its context: minutes a request on a CPU); huge values are fuzzed in process, over the
    fake engine."""
    if isinstance(body, dict):
        body = dict(body)
        for key in _LIMITS:
            if isinstance(body.get(key), int) and body[key] > cap:
                body[key] = cap
        if body.get("max_tokens") is None and body.get("max_completion_tokens") is None and (
                "prompt" in body or "messages" in body):
            body["max_tokens"] = cap
        if path == "/v1/responses" and body.get("max_output_tokens") is None:
            body["max_output_tokens"] = cap
        if isinstance(body.get("min_tokens"), int) and body["min_tokens"] > cap:
            body["min_tokens"] = cap
    return body


def _fuzz_operation(op: Any, mode: Any, report: FuzzReport, max_examples: int, seed: int,
                    cap: int | None, call_kwargs: dict[str, Any]) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from schemathesis.specs.openapi.checks import positive_data_acceptance

    counter = report.by_operation.setdefault(op.label, collections.Counter())

    @given(case=op.as_strategy(generation_mode=mode))
    @settings(max_examples=max_examples, deadline=None, database=None, derandomize=seed == 0,
              suppress_health_check=list(HealthCheck), print_blob=False)
    def fuzz(case: Any) -> None:
        if (cap is not None and mode == GenerationMode.POSITIVE and case.body is not None
                and op.path in _GENERATING):
            case.body = _cap_generation(case.body, cap, op.path)
        resp = case.call(**call_kwargs)
        report.requests += 1
        report.statuses[resp.status_code] += 1
        counter[resp.status_code] += 1
        problems = [p for p in (_check_error_body(resp), _check_stream(resp)) if p]
        try:
            case.validate_response(resp, excluded_checks=[positive_data_acceptance])
        except Exception as e:  # schemathesis' FailureGroup: conformance or a 5xx
            problems.append(str(e).split("Reproduce with")[0].strip()[:800])
        for p in problems:
            if len(report.failures) < 50:
                report.failures.append(f"{op.label} [{mode.value}] {p}")

    try:
        fuzz()
    except Unsatisfiable:  # nothing to violate (a GET without parameters, in negative mode)
        pass


def run_schemathesis(schema: Any, max_examples: int, seed: int = 0, cap_generation: int | None = None,
                     **call_kwargs: Any) -> FuzzReport:
    """Fuzz every operation of ``schema`` (a loaded schemathesis schema) in both generation modes,
    ``max_examples`` each; ``cap_generation`` bounds max_tokens of schema-valid bodies (live model)."""
    from schemathesis import GenerationMode

    report = FuzzReport()
    t0 = time.monotonic()
    for result in schema.get_all_operations():
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _fuzz_operation(result.ok(), mode, report, max_examples, seed, cap_generation, call_kwargs)
    report.seconds = time.monotonic() - t0
    return report
