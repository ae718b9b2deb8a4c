"""Where the GGML matmuls switch from their few-row kernels to their many-row ones.

Two switches, each between two kernels that give the same bits, so where it sits is a matter of
speed alone, and the row count where the many-row kernel starts to win depends on the machine
(vector width, cache sizes, load ports):

- float32 activations (``ggml_matmul.c``): row tiles that dequantize each weight block once per tile
  of a few activation rows (decode), and a panel kernel that dequantizes a thread's weight rows once
  and runs register tiles over them (``ggml_f32_panel.h``: prefill, large batches);
- int8 activations (``ggml_q8.c``, AVX-512 + VNNI builds): the decode kernel over the layers' row16
  copy (``ggml_q8_decode.c``; row tiles over the packed weights as stored in a build without it),
  and many-row tiles that lay 32 weight rows out once per call as ``vpdpbusd`` reads them
  (``ggml_q8_tile.h``).

Each is measured once -- both kernels on a gate/up-sized Q4_1 product at a ladder of row counts, best
of several interleaved rounds -- and cached beside the library (``$TOKENFAB_CACHE_DIR/cpu_kernels``),
keyed by the library build (sources, compiler, CPU). ``TOKENFAB_PANEL_MIN_ROWS`` and
``TOKENFAB_Q8_TILE_MIN_ROWS`` override them.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenfab.kernels.cpu import cache_dir, native_library

log = logging.getLogger(__name__)
CANDIDATES = (2, 3, 4, 5, 6, 8, 12, 16, 24, 32, 48, 64)
NEVER = 1 << 30
_SHAPE = (3072, 576)  # (N, K): a gate_up projection of the bundled model, in Q4_1


@dataclass(frozen=True)
class Switch:
    """One few-rows/many-rows switch of the native library: its entry points and names."""

    name: str  # result key and cache file prefix
    env: str  # the override
    product: str  # the C product (x, w, M, N, K, qtype, out)
    getter: str  # the current row count (0: this build has no many-row kernel)
    setter: str
    cache_prefix: str  # the cached measurement's file name, before the library's stem
    # int8: below the switch the layers run the row16 decode kernel where the build has it
    # (ggml_q8_decode.c), so that is the few-row side measured
    few_rows_row16: bool = False


PANEL = Switch("panel_min_rows", "TOKENFAB_PANEL_MIN_ROWS", "ggml_matmul_f32", "ggml_panel_min_rows",
               "ggml_set_panel_min_rows", "panel_crossover")
Q8_TILES = Switch("q8_tile_min_rows", "TOKENFAB_Q8_TILE_MIN_ROWS", "ggml_matmul_q8", "ggml_q8_tile_min_rows",
                  "ggml_q8_set_tile_min_rows", "q8_tile_min_rows_crossover", few_rows_row16=True)
ENV = PANEL.env
_applied: dict[str, dict] | None = None  # switch name -> what apply_crossover set (tests reset it to None)


def _cache_file(lib, switch: Switch = PANEL) -> Path:
    return cache_dir() / f"{switch.cache_prefix}_{Path(lib._name).stem}.json"


def _best_time(fn, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure(lib, rounds: int = 5, switch: Switch = PANEL) -> tuple[int, dict[int, float]]:
    """(the smallest candidate row count from which the many-row kernel is faster at it and at every
    larger candidate, else NEVER; {rows: row-tile time / many-row kernel time})."""
    n, k = _SHAPE
    gen = torch.Generator().manual_seed(0)
    w = torch.randint(0, 256, (n, k // 32 * 20), dtype=torch.uint8, generator=gen)
    w.view(n, k // 32, 20)[..., :4] = (torch.rand(n, k // 32, 2, generator=gen) * 0.01).half().view(torch.uint8).view(
        n, k // 32, 4)
    x = torch.randn(max(CANDIDATES), k, generator=gen)
    out = torch.empty(max(CANDIDATES), n)
    product, setter = getattr(lib, switch.product), getattr(lib, switch.setter)
    previous = int(getattr(lib, switch.getter)())
    ratios: dict[int, float] = {}
    few_product, few_w = product, w
    if switch.few_rows_row16 and lib.ggml_q8_row16_built():
        few_product = lib.ggml_matmul_q8_row16
        few_w = torch.empty(lib.ggml_q8_row16_bytes(n, k, 2), dtype=torch.uint8)
        lib.ggml_q8_row16_pack(w.data_ptr(), n, k, 2, few_w.data_ptr())
    try:
        for m in CANDIDATES:
            def run(m: int = m) -> None:
                product(x.data_ptr(), w.data_ptr(), m, n, k, 2, out.data_ptr())

            def run_few(m: int = m) -> None:
                few_product(x.data_ptr(), few_w.data_ptr(), m, n, k, 2, out.data_ptr())

            tiles = many = float("inf")
            for _ in range(rounds):  # interleaved: a burst of load on the machine hits both alike
                setter(NEVER)
                tiles = min(tiles, _best_time(run_few, 3))
                setter(1)
                many = min(many, _best_time(run, 3))
            ratios[m] = tiles / many
    finally:
        setter(previous)
    crossover = NEVER
    for m in reversed(CANDIDATES):
        if ratios[m] <= 1.0:
            break
        crossover = m
    return crossover, ratios


def apply_crossover(switch: Switch = PANEL) -> dict:
    """Set one switch of the library once per process: its environment override, else the cached
    measurement, else measure now and cache it. Returns {name, "source"} (also what
    ``ggml_kernel_info`` reports); {name: 0, ...} for a build without the many-row kernel."""
    global _applied
    key = switch.name
    lib = native_library()
    if lib is None:
        return {key: 0, "source": "no native library"}
    state = _applied or {}
    done = state.get(key)
    if done is not None and done.get("library") == lib._name:
        return done
    if int(getattr(lib, switch.getter)()) == 0:
        _applied = {**state, key: {key: 0, "source": "this build has no many-row kernel", "library": lib._name}}
        return _applied[key]
    raw = os.environ.get(switch.env)
    if raw:
        try:
            rows = int(raw)
        except ValueError as e:
            raise ValueError(f"{switch.env} must be a positive integer, got {raw!r}") from e
        if rows < 1:
            raise ValueError(f"{switch.env} must be a positive integer, got {raw!r}")
        result = {key: rows, "source": switch.env}
    else:
        path = _cache_file(lib, switch)
        try:
            cached = json.loads(path.read_text())
            result = {key: int(cached[key]), "source": f"cached measurement ({path})"}
        except (OSError, ValueError, KeyError, TypeError):
            rows, ratios = measure(lib, switch=switch)
            result = {key: rows, "source": "measured now",
                      "speedup_by_rows": {str(m): round(r, 3) for m, r in ratios.items()}}
            log.info("GGML %s: %d activation rows (row tiles / many-row kernel: %s)", key, rows, ratios)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps({key: rows, "speedup_by_rows": result["speedup_by_rows"]}))
                os.replace(tmp, path)
            except OSError as e:
                log.warning("could not cache the %s crossover in %s: %s", key, path, e)
    getattr(lib, switch.setter)(int(result[key]))
    _applied = {**state, key: {**result, "library": lib._name}}
    return _applied[key]
