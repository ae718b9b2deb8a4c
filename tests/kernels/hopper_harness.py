"""The harness the Hopper (sm_90) compile scripts share: a compile-only stand-in for ``kernel[grid](...)``,
the workload loop, the command line, and the tests' side (run a script in a subprocess, read its records).

Each script (``hopper_compile.py``: the general kernels; ``moe_``, ``mla_``, ``quant_``, ``w4a16_``,
``matmul_invariant_hopper_compile.py``: one family each) holds only its workloads (a label and a
function that calls an op's ``_..._triton`` launcher with CPU tensors of realistic shapes) and the
modules whose kernels it compiles. Each launch is compiled for ``GPUTarget("cuda", 90, 32)`` with
exactly the specialisation (signature, constexprs, alignment attributes, num_warps, num_stages) a
real launch would get; ``cuobjdump`` (shipped in the triton wheel) then reads registers,
shared/local memory and the SASS.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]

BF16 = torch.bfloat16
F32 = torch.float32
FP8 = torch.float8_e4m3fn
#: Workloads whose label holds this compile only when asked for (``--only fp8-kv``): the fp8-cache variants,
#: checked by the slow test in tests/kernels/test_kv_cache_fp8.py, so that the fast-tier compile test
#: (test_hopper_compile.py, every kernel at its plain configs) does not grow.
ON_REQUEST = "fp8-kv"
H100_MAX_SHARED = 227 * 1024  # opt-in shared memory per block on sm_90
Workload = tuple[str, Callable[[], None]]


def _cuobjdump() -> str:
    import triton

    return str(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")


class _Compiler:
    """Stands in for a @triton.jit kernel: ``kernel[grid](*args, **kw)`` records the launch's sm_90
    specialisation (the compile itself runs later, in ``compile_launches``)."""

    def __init__(self, jit_fn, launches: list[dict], label: Callable[[], str]):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        self.fn = jit_fn
        self.launches = launches
        self.label = label
        self.target = GPUTarget("cuda", 90, 32)
        self.backend = make_backend(self.target)
        self.binder = create_function_from_signature(jit_fn.signature, jit_fn.params, self.backend)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._record(grid, args, kwargs)

    def _record(self, grid, args, kwargs) -> None:
        bound, spec, options = self.binder(*args, **kwargs)
        options, signature, constexprs, attrs = self.fn._pack_args(self.backend, kwargs, bound, spec, options)
        const = {k: v for k, v in bound.items() if isinstance(v, (bool, int, str)) and k.isupper()}
        self.launches.append(dict(
            fn=self.fn, signature=signature, constexprs=constexprs, attrs=attrs, options=options.__dict__,
            record=dict(workload=self.label(), kernel=self.fn.__name__, grid=[int(g) for g in grid], config=const),
        ))


def _launch_key(launch: dict) -> str:
    """Two launches with the same key compile to the same binary (Triton's own cache key, less the source)."""
    return repr((launch["fn"].__module__, launch["fn"].__name__, launch["signature"], launch["constexprs"],
                 launch["attrs"], sorted(launch["options"].items())))


#: PTX's tensor-core MMAs (mma.sync, wgmma.mma_async) and async copies (cp.async): what HMMA, HGMMA,
#: QGMMA and LDGSTS in the SASS are compiled from.
_MMA_OR_ASYNC_PTX = re.compile(r"(?<![\w.])(?:wgmma|mma|cp\.async)\.")


def _compile_one(launch: dict) -> dict:
    """Compile one recorded launch for sm_90 and read its resources and SASS with cuobjdump."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.compiler import compile as triton_compile

    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ck = triton_compile(ASTSource(launch["fn"], launch["signature"], launch["constexprs"], launch["attrs"]),
                            target=GPUTarget("cuda", 90, 32), options=launch["options"])
    # Disassembling is most of cuobjdump's time: only where the PTX has an instruction the SASS counts
    # below come from (an MMA, an async copy); without one in the PTX, ptxas emits none and they are 0.
    sass = _MMA_OR_ASYNC_PTX.search(ck.asm["ptx"]) is not None
    with tempfile.TemporaryDirectory() as d:
        cubin = os.path.join(d, "k.cubin")
        with open(cubin, "wb") as f:
            f.write(ck.asm["cubin"])
        out = subprocess.run([_cuobjdump(), "--dump-resource-usage", *(["--dump-sass"] if sass else []), cubin],
                             capture_output=True, text=True, check=True).stdout
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", out)
    if m is None:
        raise RuntimeError(f"cannot read cuobjdump resource usage:\n{out[:4000]}")
    reg, stack, static_shared, local = (int(x) for x in m.groups())
    return dict(
        num_warps=ck.metadata.num_warps,
        num_stages=ck.metadata.num_stages,
        registers=reg,
        stack=stack,
        local=local,
        shared=int(ck.metadata.shared) + static_shared,
        hgmma=len(re.findall(r"\bHGMMA\b", out)),
        hmma=len(re.findall(r"\bHMMA\b", out)),
        qgmma=len(re.findall(r"\bQGMMA\b", out)),  # FP8 warp-group MMA (e4m3/e5m2 operands)
        async_copies=len(re.findall(r"\bLDGSTS\b", out)),
        sass=sass,
        compile_s=round(time.perf_counter() - t0, 2),
    )


_PENDING: list[dict] = []  # the launches a forked pool's workers compile (by index: nothing to pickle)


def _compile_pending(i: int) -> dict:
    return _compile_one(_PENDING[i])


def compile_launches(launches: list[dict], workers: int | None = None) -> list[dict]:
    """One record per launch: each distinct specialisation compiled once (launches that repeat one share
    its measurements), over a pool of ``workers`` forked processes (default: one per CPU)."""
    unique: dict[str, int] = {}
    for launch in launches:
        unique.setdefault(_launch_key(launch), len(unique))
    firsts = {i: launch for launch in launches for i in [unique[_launch_key(launch)]]}
    _PENDING[:] = [firsts[i] for i in range(len(unique))]
    workers = min(workers or os.cpu_count() or 1, len(_PENDING))
    try:
        if workers <= 1:
            measured = [_compile_pending(i) for i in range(len(_PENDING))]
        else:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: the workers only compile
                with multiprocessing.get_context("fork").Pool(workers) as pool:
                    measured = pool.map(_compile_pending, range(len(_PENDING)), chunksize=1)
    finally:
        _PENDING.clear()
    return [{**launch["record"], **measured[unique[_launch_key(launch)]]} for launch in launches]


def patch_kernels(modules: list, launches: list[dict], label: Callable[[], str]) -> list[tuple]:
    """Replace every ``*_kernel`` JIT function (defined or imported) in ``modules`` by a launcher that
    records its launches, and their ``check_device`` by a no-op; returns what to restore (``restore``)."""
    from triton.runtime.jit import JITFunction

    saved = []
    for mod in modules:
        if hasattr(mod, "check_device"):
            saved.append((mod, "check_device", mod.check_device))
            mod.check_device = lambda t: None
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, JITFunction) and name.endswith("_kernel"):
                saved.append((mod, name, obj))
                setattr(mod, name, _Compiler(obj, launches, label))
    return saved


def restore(saved: list[tuple]) -> None:
    for mod, name, obj in saved:
        setattr(mod, name, obj)


#: Set by ``collecting``: compile_workloads then only appends its launches here (and returns no records).
_collector: list[list[dict]] = []


class collecting:
    """``with collecting() as launches:`` a script's ``main`` run inside records its launches in
    ``launches`` instead of compiling them, so that several scripts share one pool (hopper_batch.py)."""

    def __enter__(self) -> list[dict]:
        _collector.append([])
        return _collector[-1]

    def __exit__(self, *exc) -> None:
        _collector.pop()


def collect_launches(modules: list, workloads: list[Workload], only: str | None = None, *,
                     on_request: str | None = None, subset: tuple[str, ...] | None = None) -> list[dict]:
    """Run the chosen workloads with ``modules``' kernels patched; one launch per ``kernel[grid](...)``.
    ``only``: the labels holding it, else every label but those holding ``on_request``; with
    ``subset``, of those only the labels it names: whole, or up to a space (``"decode fp32"`` names
    ``"decode fp32 B8 9/3 d64"``, ``"... M=1"`` does not name ``"... M=16"``)."""
    launches: list[dict] = []
    current = {"label": ""}
    saved = patch_kernels(modules, launches, lambda: current["label"])
    try:
        for label, fn in workloads:
            if (only and only not in label) or (not only and on_request and on_request in label) \
                    or (subset is not None and not any(label == s or label.startswith(s + " ") for s in subset)):
                continue
            current["label"] = label
            fn()
    finally:
        restore(saved)
    return launches


def compile_workloads(modules: list, workloads: list[Workload], only: str | None = None, *,
                      on_request: str | None = None, subset: tuple[str, ...] | None = None) -> list[dict]:
    """Compile every kernel launch of the chosen workloads (``collect_launches``); one record per launch."""
    launches = collect_launches(modules, workloads, only, on_request=on_request, subset=subset)
    if _collector:
        _collector[-1].extend(launches)
        return []
    return compile_launches(launches)


def markdown(results: list[dict]) -> str:
    lines = [
        "| workload | kernel | warps | stages | registers | shared (B) | local (B) | HGMMA |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        lines.append(
            f"| {r['workload']} | `{r['kernel']}` | {r['num_warps']} | {r['num_stages']} | {r['registers']} "
            f"| {r['shared']} | {r['local'] + r['stack']} | {r['hgmma'] or '-'} |"
        )
    return "\n".join(lines)


def run_cli(compile_all: Callable[..., list[dict]], description: str, argv: list[str] | None = None,
            quick: bool = False) -> int:
    """The command line of every Hopper compile script; ``quick`` adds a --quick flag passed on to
    ``compile_all(only, quick)``."""
    os.environ.setdefault("TRITON_INTERPRET", "0")
    if os.environ["TRITON_INTERPRET"] not in ("", "0"):
        print("set TRITON_INTERPRET=0: the Hopper compile needs real @triton.jit functions", file=sys.stderr)
        return 2
    ap = argparse.ArgumentParser(description=description)
    ap.add_argument("--json", help="write the records here")
    ap.add_argument("--markdown", action="store_true", help="print the table")
    ap.add_argument("--only", help="compile only workloads whose label contains this")
    if quick:
        ap.add_argument("--quick", action="store_true", help="only the workloads the test checks")
    args = ap.parse_args(argv)
    results = compile_all(args.only, args.quick) if quick else compile_all(args.only)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.markdown:
        print(markdown(results))
    return 0


Run = tuple[str, tuple[str, ...]]  # a compile script of this folder and its command line


def batch_records(tmp_path_factory, runs: Sequence[Run], timeout: int = 900) -> list[list[dict]]:
    """The records of every run (one list each), all compiled in one subprocess (``hopper_batch.py``:
    one pool for all) with TRITON_INTERPRET=0: the calling test process imported triton for the
    interpreter. Skips where a GPU is present: the kernel tests ran the kernels for real."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the kernel tests compiled and ran the kernels for real")
    path = tmp_path_factory.mktemp("hopper_batch") / "records.json"
    env = {k: v for k, v in os.environ.items() if k != "TOKENFAB_KERNELS"}
    env["TRITON_INTERPRET"] = "0"  # real @triton.jit functions (tokenfab.kernels._launch honours it)
    spec = json.dumps([[script, list(args)] for script, args in runs])
    proc = subprocess.run([sys.executable, str(HERE / "hopper_batch.py"), "--runs", spec, "--json", str(path)],
                          env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(path.read_text())


def script_records(tmp_path_factory, script: str, *runs: Sequence[str], timeout: int = 900) -> list[dict]:
    """The records of ``tests/kernels/<script>`` run once per argument list in ``runs`` (once with
    none by default), together (``batch_records``)."""
    per_run = batch_records(tmp_path_factory, [(script, tuple(args)) for args in runs or ((),)], timeout)
    return [r for records in per_run for r in records]


def session_batch(request, tmp_path_factory) -> Callable[[Sequence[Run]], list[dict]]:
    """The tests' ``hopper_batch`` fixture (tests/kernels/conftest.py): the runs every selected test
    asks for (its ``hopper_runs`` parameter) compiled once, in one subprocess, at the first use;
    returns the records of a test's runs."""
    wanted: list[Run] = []
    for item in request.session.items:
        for script, args in getattr(getattr(item, "callspec", None), "params", {}).get("hopper_runs", ()):
            if (script, tuple(args)) not in wanted:
                wanted.append((script, tuple(args)))
    by_run = dict(zip(wanted, batch_records(tmp_path_factory, wanted))) if wanted else {}

    def records(runs: Sequence[Run]) -> list[dict]:
        return [r for script, args in runs for r in by_run[(script, tuple(args))]]

    return records


def assert_fits_hopper(records: list[dict]) -> None:
    """Kernel rule 5's budgets: no spills (local memory, stack), a program's registers fit one
    multiprocessor's 64K, shared memory within the opt-in maximum."""
    for r in records:
        assert r["local"] == 0 and r["stack"] == 0, f"spills: {r}"
        assert r["registers"] * 32 * r["num_warps"] <= 65536, r
        assert r["shared"] <= H100_MAX_SHARED, r
