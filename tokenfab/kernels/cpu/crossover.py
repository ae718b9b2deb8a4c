"""Where the float32-activation GGML matmul switches from its row tiles to its panel kernel.

``ggml_matmul.c`` has two kernels for W4A32/W8A32 products: row tiles that dequantize each weight
block once per tile of a few activation rows (decode), and a panel kernel that dequantizes a thread's
weight rows once and runs register tiles over them (``ggml_f32_panel.h``: prefill, large batches).
They give the same bits, so the switch is a matter of speed alone, and the row count where the panel
starts to win depends on the machine (vector width, cache sizes, load ports). It is measured once --
both kernels on a gate/up-sized Q4_1 product at a ladder of row counts, best of several interleaved
rounds -- and cached beside the library (``$TOKENFAB_CACHE_DIR/cpu_kernels``), keyed by the library
build (sources, compiler, CPU). ``TOKENFAB_PANEL_MIN_ROWS`` overrides it.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path

import torch

from tokenfab.kernels.cpu import cache_dir, native_library

log = logging.getLogger(__name__)
ENV = "TOKENFAB_PANEL_MIN_ROWS"
CANDIDATES = (2, 3, 4, 5, 6, 8, 12, 16)
NEVER = 1 << 30
_SHAPE = (3072, 576)  # (N, K): a gate_up projection of the bundled model, in Q4_1
_applied: dict | None = None


def _cache_file(lib) -> Path:
    return cache_dir() / f"panel_crossover_{Path(lib._name).stem}.json"


def _best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(lib, rounds: int = 5) -> tuple[int, dict[int, float]]:
    """(the smallest candidate row count from which the panel kernel is faster at it and at every
    larger candidate, else NEVER; {rows: row-tile time / panel time})."""
    n, k = _SHAPE
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (n, k // 32 * 20), dtype=torch.uint8, generator=gen)
    w.view(n, k // 32, 20)[..., :4] = (torch.rand(n, k // 32, 2, generator=gen) * 0.01).half().view(torch.uint8).view(
        n, k // 32, 4)
    x = torch.randn(max(CANDIDATES), k, generator=gen)
    out = torch.empty(max(CANDIDATES), n)
    previous = int(lib.ggml_panel_min_rows())
    ratios: dict[int, float] = {}
    try:
        for m in CANDIDATES:
            def run(m: int = m) -> None:
                lib.ggml_matmul_f32(x.data_ptr(), w.data_ptr(), m, n, k, 2, out.data_ptr())

            tiles = panel = float("inf")
            for _ in range(rounds):  # interleaved: a burst of load on the machine hits both alike
                lib.ggml_set_panel_min_rows(NEVER)
                tiles = min(tiles, _best_time(run, 3))
                lib.ggml_set_panel_min_rows(1)
                panel = min(panel, _best_time(run, 3))
            ratios[m] = tiles / panel
    finally:
        lib.ggml_set_panel_min_rows(previous)
    crossover = NEVER
    for m in reversed(CANDIDATES):
        if ratios[m] <= 1.0:
            break
        crossover = m
    return crossover, ratios


def apply_crossover() -> dict:
    """Set the library's crossover once per process: ``TOKENFAB_PANEL_MIN_ROWS``, else the cached
    measurement, else measure now and cache it. Returns {"panel_min_rows", "source"} (also what
    ``ggml_kernel_info`` reports); {"panel_min_rows": 0, ...} for a build without the panel kernel."""
    global _applied
    lib = native_library()
    if lib is None:
        return {"panel_min_rows": 0, "source": "no native library"}
    if _applied is not None and _applied.get("library") == lib._name:
        return _applied
    if int(lib.ggml_panel_min_rows()) == 0:
        _applied = {"panel_min_rows": 0, "source": "this build has no panel kernel", "library": lib._name}
        return _applied
    raw = os.environ.get(ENV)
    if raw:
        try:
            rows = int(raw)
        except ValueError as e:
            raise ValueError(f"{ENV} must be a positive integer, got {raw!r}") from e
        if rows < 1:
            raise ValueError(f"{ENV} must be a positive integer, got {raw!r}")
        result = {"panel_min_rows": rows, "source": ENV}
    else:
        path = _cache_file(lib)
        result = None
        try:
            cached = json.loads(path.read_text())
            result = {"panel_min_rows": int(cached["panel_min_rows"]), "source": f"cached measurement ({path})"}
        except (OSError, ValueError, KeyError, TypeError):
            rows, ratios = measure(lib)
            result = {"panel_min_rows": rows, "source": "measured now",
                      "speedup_by_rows": {str(m): round(r, 3) for m, r in ratios.items()}}
            log.info("GGML f32 panel kernel from %d activation rows (row tiles / panel: %s)", rows, ratios)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps({"panel_min_rows": rows, "speedup_by_rows": result["speedup_by_rows"]}))
                os.replace(tmp, path)
            except OSError as e:
                log.warning("could not cache the panel crossover in %s: %s", path, e)
    lib.ggml_set_panel_min_rows(int(result["panel_min_rows"]))
    _applied = {**result, "library": lib._name}
    return _applied
