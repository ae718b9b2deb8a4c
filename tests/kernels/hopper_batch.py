"""Run several Hopper (sm_90) compile scripts in one process and one compile pool.

Each run is a script of this folder and its command line (``hopper_compile.py``,
``w4a16_hopper_compile.py --only M=1``, ...). Every run's ``main`` records its launches
(``hopper_harness.collecting``) instead of compiling them; the launches of all runs are then
compiled together (``hopper_harness.compile_launches``: each distinct specialisation once, over one
process per CPU), and the records written as one list per run. ``hopper_harness.batch_records``
(the tests' session fixture) runs it in a subprocess:
    TRITON_INTERPRET=0 python tests/kernels/hopper_batch.py --json out.json \\
        --runs '[["hopper_compile.py", []], ["moe_hopper_compile.py", ["--quick"]]]'
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.kernels.hopper_harness import collecting, compile_launches  # noqa: E402


def batch(runs: list[tuple[str, list[str]]]) -> list[list[dict]]:
    """The records of every run (a script's file name and its arguments), in order."""
    launches: list[list[dict]] = []
    for script, argv in runs:
        module = importlib.import_module(f"tests.kernels.{Path(script).stem}")
        with collecting() as found:
            rc = module.main(list(argv))
        if rc != 0:
            raise RuntimeError(f"{script} {argv}: exit status {rc}")
        launches.append(found)
    records = compile_launches([launch for run in launches for launch in run])
    out, start = [], 0
    for run in launches:
        out.append(records[start:start + len(run)])
        start += len(run)
    return out


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("TRITON_INTERPRET", "0")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", required=True, help='JSON: [[script, [args...]], ...]')
    ap.add_argument("--json", required=True, help="write the records here: one list per run")
    args = ap.parse_args(argv)
    Path(args.json).write_text(json.dumps(batch([(s, list(a)) for s, a in json.loads(args.runs)]), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
