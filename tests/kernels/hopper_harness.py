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
    """Stands in for a @triton.jit kernel: ``kernel[grid](*args, **kw)`` compiles for sm_90."""

    def __init__(self, jit_fn, results: list[dict], label: Callable[[], str]):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        self.fn = jit_fn
        self.results = results
        self.label = label
        self.target = GPUTarget("cuda", 90, 32)
        self.backend = make_backend(self.target)
        self.binder = create_function_from_signature(jit_fn.signature, jit_fn.params, self.backend)

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self._compile(grid, args, kwargs)

    def _compile(self, grid, args, kwargs) -> None:
        from triton.compiler import ASTSource
        from triton.compiler import compile as triton_compile

        t0 = time.perf_counter()
        bound, spec, options = self.binder(*args, **kwargs)
        options, signature, constexprs, attrs = self.fn._pack_args(self.backend, kwargs, bound, spec, options)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ck = triton_compile(ASTSource(self.fn, signature, constexprs, attrs), target=self.target,
                                options=options.__dict__)
        with tempfile.TemporaryDirectory() as d:
            cubin = os.path.join(d, "k.cubin")
            with open(cubin, "wb") as f:
                f.write(ck.asm["cubin"])
            usage = subprocess.run([_cuobjdump(), "--dump-resource-usage", cubin], capture_output=True,
                                   text=True, check=True).stdout
            sass = subprocess.run([_cuobjdump(), "--dump-sass", cubin], capture_output=True, text=True,
                                  check=True).stdout
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", usage)
        if m is None:
            raise RuntimeError(f"cannot read cuobjdump resource usage:\n{usage}")
        reg, stack, static_shared, local = (int(x) for x in m.groups())
        const = {k: v for k, v in bound.items() if isinstance(v, (bool, int, str)) and k.isupper()}
        self.results.append(dict(
            workload=self.label(),
            kernel=self.fn.__name__,
            grid=[int(g) for g in grid],
            config=const,
            num_warps=ck.metadata.num_warps,
            num_stages=ck.metadata.num_stages,
            registers=reg,
            stack=stack,
            local=local,
            shared=int(ck.metadata.shared) + static_shared,
            hgmma=len(re.findall(r"\bHGMMA\b", sass)),
            hmma=len(re.findall(r"\bHMMA\b", sass)),
            qgmma=len(re.findall(r"\bQGMMA\b", sass)),  # FP8 warp-group MMA (e4m3/e5m2 operands)
            async_copies=len(re.findall(r"\bLDGSTS\b", sass)),
            compile_s=round(time.perf_counter() - t0, 2),
        ))


def patch_kernels(modules: list, results: list[dict], label: Callable[[], str]) -> list[tuple]:
    """Replace every ``*_kernel`` JIT function (defined or imported) in ``modules`` by a compile-only
    launcher and their ``check_device`` by a no-op; returns what to restore (``restore``)."""
    from triton.runtime.jit import JITFunction

    saved = []
    for mod in modules:
        if hasattr(mod, "check_device"):
            saved.append((mod, "check_device", mod.check_device))
            mod.check_device = lambda t: None
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, JITFunction) and name.endswith("_kernel"):
                saved.append((mod, name, obj))
                setattr(mod, name, _Compiler(obj, results, label))
    return saved


def restore(saved: list[tuple]) -> None:
    for mod, name, obj in saved:
        setattr(mod, name, obj)


def compile_workloads(modules: list, workloads: list[Workload], only: str | None = None, *,
                      on_request: str | None = None, subset: tuple[str, ...] | None = None) -> list[dict]:
    """Compile every kernel launch of the chosen workloads with ``modules``' kernels patched; one
    record per launch. ``only``: the labels holding it, else every label but those holding
    ``on_request``; with ``subset``, of those only the labels starting with one of its prefixes."""
    results: list[dict] = []
    current = {"label": ""}
    saved = patch_kernels(modules, results, lambda: current["label"])
    try:
        for label, fn in workloads:
            if (only and only not in label) or (not only and on_request and on_request in label) \
                    or (subset is not None and not label.startswith(subset)):
                continue
            current["label"] = label
            fn()
    finally:
        restore(saved)
    return results


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


def script_records(tmp_path_factory, script: str, *runs: Sequence[str], timeout: int = 600) -> list[dict]:
    """The records of ``tests/kernels/<script>`` run once per argument list in ``runs`` (once with
    none by default), each in a subprocess with TRITON_INTERPRET=0: the calling test process imported
    triton for the interpreter. Skips where a GPU is present: the kernel tests ran the kernels for real."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the kernel tests compiled and ran the kernels for real")
    out = tmp_path_factory.mktemp(Path(script).stem)
    env = {k: v for k, v in os.environ.items() if k != "TOKENFAB_KERNELS"}
    env["TRITON_INTERPRET"] = "0"  # real @triton.jit functions (tokenfab.kernels._launch honours it)
    records: list[dict] = []
    for i, args in enumerate(runs or ((),)):
        path = out / f"compile_{i}.json"
        proc = subprocess.run([sys.executable, str(HERE / script), *args, "--json", str(path)], env=env,
                              capture_output=True, text=True, timeout=timeout, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-4000:]
        records += json.loads(path.read_text())
    return records


def assert_fits_hopper(records: list[dict]) -> None:
    """Kernel rule 5's budgets: no spills (local memory, stack), a program's registers fit one
    multiprocessor's 64K, shared memory within the opt-in maximum."""
    for r in records:
        assert r["local"] == 0 and r["stack"] == 0, f"spills: {r}"
        assert r["registers"] * 32 * r["num_warps"] <= 65536, r
        assert r["shared"] <= H100_MAX_SHARED, r
