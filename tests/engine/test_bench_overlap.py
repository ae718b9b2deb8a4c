"""`tokenfab bench overlap`: the harness that brackets each forward with timeline marks, and its
CPU run end to end (host clock; on a GPU the same code records CUDA events)."""

from __future__ import annotations

import argparse
import json
import types

import pytest

from tokenfab.bench import overlap


class _Clock:
    """Marks that read a counter the test moves: gaps and forward times are known exactly."""

    cuda = False

    def __init__(self) -> None:
        self.now = 0.0

    def mark(self) -> float:
        return self.now

    def ms(self, a: float, b: float) -> float:
        return b - a


def test_gaps_are_between_consecutive_decode_forwards():
    clock = _Clock()
    log: list = []

    class Runner:
        def execute(self, batch):
            clock.now += batch.cost  # the forward
            return batch.max_query_len

    runner = Runner()
    undo = overlap.instrument(runner, clock, log)
    for q_len, cost, gap in ((7, 5.0, 2.0), (1, 1.0, 0.5), (1, 1.5, 0.25), (1, 2.0, 3.0), (4, 9.0, 1.0), (1, 1.0, 0)):
        assert runner.execute(types.SimpleNamespace(max_query_len=q_len, cost=cost)) == q_len
        clock.now += gap  # the host between forwards
    undo()
    assert "execute" not in vars(runner)  # the class's method again
    gaps, forwards = overlap.step_gaps(log, clock)
    assert gaps == [0.5, 0.25]  # prefill -> decode and decode -> prefill gaps are not step gaps
    assert forwards == [1.0, 1.5, 2.0, 1.0]


@pytest.mark.slow  # two engine loads and a random model: ~17 s on a loaded 2-core machine
def test_cpu_run_reports_both_modes_with_the_same_tokens(tmp_path, capsys):
    out = tmp_path / "overlap.json"
    args = argparse.Namespace(model=None, shape="tiny", batch_sizes="1,3", input_len=8, output_len=6, rounds=1,
                              dtype="float32", device="cpu", enforce_eager=True, json=str(out),
                              markdown=str(tmp_path / "overlap.md"))
    assert overlap.run(args) == 0
    report = json.loads(out.read_text())
    assert report["benchmark"] == "overlap" and report["timeline"].startswith("host clock")
    rows = {(r["batch"], r["mode"]): r for r in report["results"]}
    assert set(rows) == {(b, m) for b in (1, 3) for m in ("sync", "async")}
    for r in rows.values():
        assert r["same_tokens"] is True
        assert r["decode_steps"] >= 5 and r["forward_ms_mean"] > 0 and r["gap_ms_mean"] >= 0
        assert 0 <= r["gap_share"] < 1 and r["output_tok_s"] > 0
    assert "gap ms mean" in capsys.readouterr().out
