"""The llama.cpp peer of `tokenfab bench serve --llama-cpp`: start `llama_cpp.server` on the bundled
GGUF (``scripts/llama_cpp_server.sh serve``, built by ``... build``), read its settings, adapt the
request body to it, stop it.

Its requests ask for the same work as ours: greedy (temperature 0, repeat penalty 1: its default
of 1.1 would change the tokens and add work), exactly ``max_tokens`` tokens (``min_tokens`` =
``max_tokens``: its equivalent of ``ignore_eos``), the same prompts. `llama_cpp.server` serves one
request at a time (a lock around its single context) and drops concurrent *streamed* requests,
so the benchmark streams to it only at concurrency 1 and sends it non-streamed requests above.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "llama_cpp_server.sh"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def peer_payload(payload: dict[str, Any]) -> dict[str, Any]:
    """Our request body, said the way llama_cpp.server understands it (same work)."""
    p = {k: v for k, v in payload.items() if k not in ("ignore_eos", "stream_options")}
    if payload.get("ignore_eos"):
        p["min_tokens"] = payload["max_tokens"]
    p["repeat_penalty"] = 1.0
    return p


def settings() -> dict[str, Any]:
    """The peer's build and run settings (``llama_cpp_server.sh info``)."""
    out = subprocess.run(["bash", str(SCRIPT), "info"], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise RuntimeError(f"llama_cpp_server.sh info failed: {out.stderr.strip()[-500:]}")
    info = json.loads(out.stdout.strip().splitlines()[-1])
    info["requests"] = ("greedy (temperature 0, repeat_penalty 1), min_tokens = max_tokens (its ignore_eos); "
                        "streamed at concurrency 1 only (llama_cpp.server drops concurrent streamed requests), "
                        "non-streamed above; one request at a time (its server has no batching)")
    return info


class LlamaCppServer:
    """``llama_cpp_server.sh COMMAND PORT`` in a child process, ready once ``ready_path`` answers 200:
    ``serve`` (llama_cpp.server, ready on /v1/models) by default; ``serve-native`` (llama-server,
    ready on /health once the model is loaded) for `LlamaServer`."""

    name = "llama.cpp server"

    def __init__(self, port: int | None = None, startup_timeout: float = 180.0, command: str = "serve",
                 env: dict[str, str] | None = None, ready_path: str = "/v1/models") -> None:
        import httpx

        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(os.environ.get("TMPDIR", "/tmp")) / f"llama_cpp_{command}_{self.port}.log"
        with open(self.log, "wb") as fh:
            self.proc = subprocess.Popen(["bash", str(SCRIPT), command, str(self.port)], stdout=fh,
                                         stderr=subprocess.STDOUT, start_new_session=True,
                                         env={**os.environ, **(env or {})})
        deadline = time.monotonic() + startup_timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited ({self.proc.returncode}); log: "
                                   f"{self.log.read_text(errors='replace')[-800:]}")
            try:
                if httpx.get(f"{self.url}{ready_path}", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"{self.name} did not answer within {startup_timeout:.0f}s; log: {self.log}")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)

    def __enter__(self) -> LlamaCppServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
