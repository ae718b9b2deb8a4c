"""The native llama.cpp peer of `tokenfab bench serve --llama-server`: llama.cpp's own `llama-server`
with parallel slots and continuous batching (``scripts/llama_cpp_server.sh serve-native PORT``:
``-np LLAMA_CPP_PARALLEL -cb``, the same threads as our engine), built from the llama.cpp tree
vendored in the llama-cpp-python sdist by ``scripts/llama_cpp_server.sh build-tools``.

Unlike `llama_cpp.server` it decodes its slots together and streams every one of them, so the
benchmark streams to it at every concurrency level. Its requests ask for the same work as ours:
greedy (temperature 0: its sampler keeps only the top token), exactly ``max_tokens`` tokens
(``n_predict`` and ``ignore_eos: true``, both llama-server request fields), repeat penalty 1
(its default, said explicitly), the same prompts; ``stream_options.include_usage`` gives the
final usage, and vLLM's ``continuous_usage_stats`` (which it does not implement) is dropped.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import httpx

from tokenfab.bench.llama_cpp_peer import LlamaCppServer
from tokenfab.bench.llama_cpp_tools import tools_dir, tools_settings

DEFAULT_PARALLEL = 16
BUILD_HINT = "scripts/llama_cpp_server.sh build-tools"


def binary() -> Path:
    """Where ``build-tools`` puts llama-server (``$LLAMA_CPP_TOOLS/bin``, default ``.llama-cpp-tools/bin``)."""
    return tools_dir() / "llama-server"


def missing_binary_message() -> str | None:
    """None when llama-server is built, else what to run to build it."""
    path = binary()
    if os.access(path, os.X_OK):
        return None
    return f"--llama-server: no llama-server at {path}; build it with `{BUILD_HINT}` (about 40 minutes on 2 cores)"


def server_payload(payload: dict[str, Any]) -> dict[str, Any]:
    """Our request body, said the way llama-server understands it (same work)."""
    p = {k: v for k, v in payload.items() if k != "stream_options"}
    if "max_tokens" in payload:
        p["n_predict"] = payload["max_tokens"]
    if payload.get("stream_options", {}).get("include_usage"):
        p["stream_options"] = {"include_usage": True}
    p["repeat_penalty"] = 1.0
    return p


def _env(parallel: int) -> dict[str, str]:
    return {"LLAMA_CPP_PARALLEL": str(parallel), "LLAMA_CPP_TOOLS": str(tools_dir().parent)}


def version_line() -> str:
    """The first line of ``llama-server --version`` (e.g. ``version: 0.5.0-dev (build 0, commit unknown)``)
    and the compiler line after it."""
    out = subprocess.run([str(binary()), "--version"], capture_output=True, text=True, timeout=60)
    lines = [ln.strip() for ln in (out.stdout + out.stderr).splitlines() if ln.strip()]
    return " / ".join(lines[-2:])


def settings(parallel: int, url: str | None = None) -> dict[str, Any]:
    """The peer's build and run settings: the tools' source and cmake flags (``llama_cpp_server.sh
    tools-info``), llama-server's own version, the command-line settings of ``serve-native`` and,
    when ``url`` is given, what the running server reports at /props (slots, per-slot context)."""
    n_ctx = int(os.environ.get("LLAMA_CPP_N_CTX", "2048"))
    threads = int(os.environ.get("LLAMA_CPP_THREADS", "2"))
    try:
        info = tools_settings()
    except (RuntimeError, ValueError, OSError) as e:  # tools-info needs llama-bench too: the flags still exist
        flags = tools_dir().parent / "cmake_args.txt"
        info = {"cmake_args": flags.read_text().strip() if flags.exists() else None, "tools_info_error": str(e)}
    info.update({
        "name": "llama.cpp llama-server (native, continuous batching)",
        "binary": str(binary()),
        "version": version_line(),
        "n_parallel": parallel, "continuous_batching": True, "n_threads": threads, "n_threads_batch": threads,
        "n_ctx_per_slot": n_ctx, "n_ctx": n_ctx * parallel, "n_batch": 2048, "n_ubatch": 512,
        "command": f"llama-server -m MODEL -t {threads} -tb {threads} -c {n_ctx * parallel} -np {parallel} -cb "
                   "-b 2048 -ub 512 (scripts/llama_cpp_server.sh serve-native)",
        "weights": "the GGUF's own quantization, computed natively",
        "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"),
        "requests": "greedy (temperature 0, repeat_penalty 1), n_predict = max_tokens with ignore_eos, "
                    "streamed at every concurrency (its slots decode together)",
    })
    if url is not None:
        props = httpx.get(f"{url}/props", timeout=10).json()
        info.update({"total_slots": props.get("total_slots"), "model": props.get("model_path"),
                     "model_ftype": props.get("model_ftype"), "build_info": props.get("build_info"),
                     "slot_n_ctx": (props.get("default_generation_settings") or {}).get("n_ctx")})
    return info


class LlamaServer(LlamaCppServer):
    """``llama_cpp_server.sh serve-native PORT`` with ``parallel`` slots (default ``$LLAMA_CPP_PARALLEL``
    or 16), ready once /health answers 200 (it answers 503 while the model loads)."""

    name = "llama-server"

    def __init__(self, parallel: int | None = None, port: int | None = None,
                 startup_timeout: float = 180.0) -> None:
        self.parallel = parallel or int(os.environ.get("LLAMA_CPP_PARALLEL", DEFAULT_PARALLEL))
        super().__init__(port, startup_timeout, command="serve-native", env=_env(self.parallel),
                         ready_path="/health")
