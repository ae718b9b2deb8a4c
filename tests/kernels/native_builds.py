"""The native CPU library (``tokenfab/kernels/cpu``) built for other targets, once per test session.

Several test modules run the kernels as other machines build them (``TOKENFAB_CPU_CFLAGS``): the
portable C loops of a machine without AVX2, the AVX2 path without VNNI, ... Each build takes seconds
of ``-O3`` compiling, so every flag set is compiled once per session, into a fresh cache directory
(``TOKENFAB_CACHE_DIR``) of its own, and every test that needs it runs a subprocess on that cache.
The first request compiles through the library's own ``_build`` (the path a user's first run takes).
"""

from __future__ import annotations

import atexit
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest

import tokenfab.kernels.cpu as native_lib

ROOT = Path(__file__).resolve().parents[2]
# no AVX at all: the kernels' portable C (every family reports "scalar"), compiler-vectorized with SSE;
# the C has no SSE-level #ifdef, so this is also what plain x86-64 runs
PORTABLE = "-march=x86-64-v2"
# AVX2 + FMA + F16C without VNNI: Haswell's level
AVX2 = "-march=x86-64-v3"

_lock = threading.Lock()
_built: dict[str, Path] = {}
_root: list[Path] = []


def _session_root() -> Path:
    if not _root:
        root = Path(tempfile.mkdtemp(prefix="tokenfab_native_builds_"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)
        _root.append(root)
    return _root[0]


def cache_dir(cflags: str) -> Path:
    """The ``TOKENFAB_CACHE_DIR`` whose ``cpu_kernels/`` holds the library built with ``cflags``
    (compiled on the first call of the session, reused after)."""
    with _lock:
        if cflags not in _built:
            cc = native_lib._compiler()
            if cc is None:
                pytest.skip("no C compiler: the native kernels cannot be built")
            where = _session_root() / (re.sub(r"[^A-Za-z0-9]+", "_", cflags).strip("_") or "default")
            with pytest.MonkeyPatch.context() as mp:
                mp.setenv("TOKENFAB_CPU_CFLAGS", cflags)
                mp.setenv("TOKENFAB_CACHE_DIR", str(where))
                native_lib._build(cc)
            _built[cflags] = where
        return _built[cflags]


def build_env(cflags: str) -> dict[str, str]:
    """The environment of a process that loads the ``cflags`` build (native kernels on, the repository
    importable)."""
    env = dict(os.environ, TOKENFAB_CPU_CFLAGS=cflags, TOKENFAB_CACHE_DIR=str(cache_dir(cflags)))
    env.pop("TOKENFAB_CPU_NATIVE", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    return env


def start_python(cflags: str, args: list[str]) -> subprocess.Popen:
    """``python *args`` on the ``cflags`` build, from the repository root, started (see ``finish``)."""
    return subprocess.Popen([sys.executable, *args], env=build_env(cflags), cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 600) -> str:
    """The stdout of a ``start_python`` process, which must succeed within ``timeout`` seconds."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    assert proc.returncode == 0, err[-3000:]
    return out


def run_python(cflags: str, args: list[str], timeout: float = 600) -> str:
    """``python *args`` on the ``cflags`` build, from the repository root; its stdout (it must succeed)."""
    return finish(start_python(cflags, args), timeout)
