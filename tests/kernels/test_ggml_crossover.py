"""The f32 GGML product's two kernels (row tiles for few rows, the panel for many: ggml_f32_panel.h)
give the same bits, as do the int8 product's (row tiles, many-row VNNI tiles: tests/kernels/
test_ggml_q8_tiles.py), so where each switch sits is speed alone; each is measured once on the
machine and cached, and ``TOKENFAB_PANEL_MIN_ROWS`` / ``TOKENFAB_Q8_TILE_MIN_ROWS`` override it
(kernels/cpu/crossover.py)."""

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
    before, before_q8 = int(lib.ggml_panel_min_rows()), int(lib.ggml_q8_tile_min_rows())
    yield
    lib.ggml_set_panel_min_rows(before)
    if before_q8:
        lib.ggml_q8_set_tile_min_rows(before_q8)


def _switches():
    """Both switches where this build has both kernels (the int8 many-row tiles: AVX-512 + VNNI)."""
    out = [crossover.PANEL]
    if int(lib.ggml_q8_tile_min_rows()):
        out.append(crossover.Q8_TILES)
    return out


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


@pytest.mark.parametrize("switch", _switches(), ids=lambda s: s.name)
def test_environment_overrides_and_is_checked(monkeypatch, restore_setting, switch):
    monkeypatch.setattr(crossover, "_applied", None)
    monkeypatch.setenv(switch.env, "7")
    got = crossover.apply_crossover(switch)
    assert got[switch.name] == 7 and got["source"] == switch.env and int(getattr(lib, switch.getter)()) == 7
    assert gm.ggml_kernel_info()["f32_panel_min_rows" if switch is crossover.PANEL else "q8_tile_min_rows"] == 7
    for bad in ("0", "-3", "many"):
        monkeypatch.setattr(crossover, "_applied", None)
        monkeypatch.setenv(switch.env, bad)
        with pytest.raises(ValueError, match=switch.env):
            crossover.apply_crossover(switch)


def test_measured_once_then_read_from_the_cache(monkeypatch, tmp_path, restore_setting):
    monkeypatch.delenv(crossover.ENV, raising=False)
    monkeypatch.setattr(crossover, "_applied", None)
    monkeypatch.setattr(crossover, "cache_dir", lambda: tmp_path)
    calls = []
    monkeypatch.setattr(crossover, "measure",
                        lambda lib_, rounds=5, switch=crossover.PANEL: calls.append(1) or (5, {5: 1.3}))
    first = crossover.apply_crossover()
    assert first["panel_min_rows"] == 5 and first["source"] == "measured now" and calls == [1]
    assert json.loads(next(tmp_path.glob("panel_crossover_*.json")).read_text())["panel_min_rows"] == 5
    monkeypatch.setattr(crossover, "_applied", None)
    second = crossover.apply_crossover()
    assert second["panel_min_rows"] == 5 and second["source"].startswith("cached") and calls == [1]
    assert int(lib.ggml_panel_min_rows()) == 5 and gm.ggml_kernel_info()["f32_panel_min_rows"] == 5


@pytest.mark.parametrize("switch", _switches(), ids=lambda s: s.name)
def test_measure_reports_every_candidate_and_restores_the_setting(restore_setting, switch):
    getattr(lib, switch.setter)(9)
    rows, ratios = crossover.measure(lib, rounds=1, switch=switch)
    assert set(ratios) == set(crossover.CANDIDATES) and all(r > 0 for r in ratios.values())
    assert rows == crossover.NEVER or rows in crossover.CANDIDATES
    # the crossover is the start of the run of winning candidates that reaches the largest one
    wins = [m for m in crossover.CANDIDATES if m >= rows]
    assert all(ratios[m] > 1.0 for m in wins)
    assert int(getattr(lib, switch.getter)()) == 9


def test_the_two_switches_are_cached_apart(monkeypatch, tmp_path, restore_setting):
    """Each switch measures once into its own file; one's measurement never stands in for the other's."""
    if crossover.Q8_TILES not in _switches():
        pytest.skip("this build has no int8 many-row tiles (AVX-512 + AVX512-VNNI only)")
    for switch in _switches():
        monkeypatch.delenv(switch.env, raising=False)
    monkeypatch.setattr(crossover, "_applied", None)
    monkeypatch.setattr(crossover, "cache_dir", lambda: tmp_path)
    calls = []

    def fake(lib_, rounds=5, switch=crossover.PANEL):
        calls.append(switch.name)
        return (6, {6: 1.2}) if switch is crossover.PANEL else (3, {3: 1.1})

    monkeypatch.setattr(crossover, "measure", fake)
    assert crossover.apply_crossover(crossover.Q8_TILES)["q8_tile_min_rows"] == 3
    assert crossover.apply_crossover()["panel_min_rows"] == 6
    assert crossover.apply_crossover(crossover.Q8_TILES)["q8_tile_min_rows"] == 3  # once per process
    assert calls == ["q8_tile_min_rows", "panel_min_rows"]
    assert sorted(p.name.split("_crossover_")[0] for p in tmp_path.glob("*_crossover_*.json")) == [
        "panel", "q8_tile_min_rows"]
    assert int(lib.ggml_q8_tile_min_rows()) == 3 and int(lib.ggml_panel_min_rows()) == 6
