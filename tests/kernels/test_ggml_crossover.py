"""The f32 GGML product's two kernels (row tiles for few rows, the panel for many: ggml_f32_panel.h)
give the same bits, so where the switch sits is speed alone; the switch is measured once on the
machine and cached, and ``TOKENFAB_PANEL_MIN_ROWS`` overrides it (kernels/cpu/crossover.py)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.kernels.test_ggml_matmul import QTYPES, _weights, _x
from tokenfab.kernels.cpu import crossover, native_library
from tokenfab.kernels.cpu import ggml_matmul as gm

lib = native_library()
pytestmark = pytest.mark.skipif(lib is None or int(lib.ggml_panel_min_rows()) == 0,
                                reason="no native library, or a build without the panel kernel (portable C)")


@pytest.fixture
def restore_setting():
    before = int(lib.ggml_panel_min_rows())
    yield
    lib.ggml_set_panel_min_rows(before)


def _product(x, packed, qtype, k, min_rows):
    lib.ggml_set_panel_min_rows(min_rows)
    return gm.ggml_matmul(x, packed, qtype, k)


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("k", [32, 96, 576, 32 * 259])
def test_panel_and_row_tiles_give_the_same_bits(qtype, k, restore_setting):
    """Odd row counts and weight rows (partial register tiles, a partial NC chunk), odd block counts,
    rows of more than one scale chunk: every row equal bit for bit, and equal to a one-row product."""
    packed, _ = _weights(qtype, 37, k)
    x = _x(13, k)
    tiles = _product(x, packed, qtype, k, crossover.NEVER)
    panel = _product(x, packed, qtype, k, 1)
    assert torch.equal(tiles, panel)
    lib.ggml_set_panel_min_rows(crossover.NEVER)
    assert torch.equal(gm.ggml_matmul(x[5:6], packed, qtype, k), panel[5:6])


def test_environment_overrides_and_is_checked(monkeypatch, restore_setting):
    monkeypatch.setattr(crossover, "_applied", None)
    monkeypatch.setenv(crossover.ENV, "7")
    got = crossover.apply_crossover()
    assert got["panel_min_rows"] == 7 and got["source"] == crossover.ENV and int(lib.ggml_panel_min_rows()) == 7
    for bad in ("0", "-3", "many"):
        monkeypatch.setattr(crossover, "_applied", None)
        monkeypatch.setenv(crossover.ENV, bad)
        with pytest.raises(ValueError, match=crossover.ENV):
            crossover.apply_crossover()


def test_measured_once_then_read_from_the_cache(monkeypatch, tmp_path, restore_setting):
    monkeypatch.delenv(crossover.ENV, raising=False)
    monkeypatch.setattr(crossover, "_applied", None)
    monkeypatch.setattr(crossover, "cache_dir", lambda: tmp_path)
    calls = []
    monkeypatch.setattr(crossover, "measure", lambda lib_, rounds=5: calls.append(1) or (5, {5: 1.3}))
    first = crossover.apply_crossover()
    assert first["panel_min_rows"] == 5 and first["source"] == "measured now" and calls == [1]
    assert json.loads(next(tmp_path.glob("panel_crossover_*.json")).read_text())["panel_min_rows"] == 5
    monkeypatch.setattr(crossover, "_applied", None)
    second = crossover.apply_crossover()
    assert second["panel_min_rows"] == 5 and second["source"].startswith("cached") and calls == [1]
    assert int(lib.ggml_panel_min_rows()) == 5 and gm.ggml_kernel_info()["f32_panel_min_rows"] == 5


def test_measure_reports_every_candidate_and_restores_the_setting(restore_setting):
    lib.ggml_set_panel_min_rows(9)
    rows, ratios = crossover.measure(lib, rounds=1)
    assert set(ratios) == set(crossover.CANDIDATES) and all(r > 0 for r in ratios.values())
    assert rows == crossover.NEVER or rows in crossover.CANDIDATES
    # the crossover is the start of the run of winning candidates that reaches the largest one
    wins = [m for m in crossover.CANDIDATES if m >= rows]
    assert all(ratios[m] > 1.0 for m in wins)
    assert int(lib.ggml_panel_min_rows()) == 9
