"""The CPU thread plan (engine/runner/cpu_threads.py): budgets from the affinity mask and the
container quota, disjoint slices for TP ranks and DP replicas, the precedence of the settings, and
the native kernels following the count on every calling thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from tokenfab.engine.runner import cpu_threads as ct
from tokenfab.kernels.cpu import native_library

ROOT = Path(__file__).resolve().parents[2]


@given(st.lists(st.integers(0, 511), min_size=1, max_size=64, unique=True), st.integers(1, 80))
def test_split_is_disjoint_and_even(cpus, parts):
    slices = ct.split_cpus(sorted(cpus), parts)
    assert len(slices) == parts and all(slices)
    if len(cpus) >= parts:
        flat = [c for s in slices for c in s]
        assert sorted(flat) == sorted(cpus)  # every core once: disjoint and covering
        assert max(map(len, slices)) - min(map(len, slices)) <= 1
    else:  # fewer cores than processes: one core each, round-robin
        assert all(len(s) == 1 for s in slices)
        assert {s[0] for s in slices} == set(cpus)


def test_split_rejects_zero_parts():
    with pytest.raises(ValueError, match="parts"):
        ct.split_cpus([0, 1], 0)


@pytest.mark.parametrize(("files", "want"), [
    ({"cpu.max": "max 100000\n"}, None),
    ({"cpu.max": "150000 100000\n"}, 2),
    ({"cpu.max": "50000 100000\n"}, 1),
    ({"cpu/cpu.cfs_quota_us": "300000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 3),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None),
    ({"cpu.max": "garbage\n"}, None),
    ({}, None),
])
def test_cgroup_quota(tmp_path, files, want):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    assert ct.cgroup_cpu_limit(tmp_path) == want


def test_usable_cpus_are_cut_to_the_quota(tmp_path):
    (tmp_path / "cpu.max").write_text("100000 100000\n")
    assert ct.usable_cpus(tmp_path) == sorted(os.sched_getaffinity(0))[:1]
    assert ct.usable_cpus(tmp_path / "none") == sorted(os.sched_getaffinity(0))


def test_plan_precedence():
    env = {ct.CPUS_ENV: "2,3,5", "OMP_NUM_THREADS": "7"}
    assert ct.plan_threads(4, environ=env) == ct.CpuThreads(4, None, "--cpu-threads")
    assert ct.plan_threads(None, environ=env).cpus == (2, 3, 5)
    assert ct.plan_threads(None, environ=env).threads == 3
    # rank 0 of a TP group of 2 takes the first slice of its own share, pinned
    assert ct.plan_threads(None, (0, 2), environ=env).cpus == (2,)
    assert ct.plan_threads(None, (1, 2), environ=env).cpus == (3, 5)
    assert ct.plan_threads(None, (0, 1), environ=env).cpus == (2, 3, 5)  # a single rank: the whole share
    only_omp = ct.plan_threads(None, environ={"OMP_NUM_THREADS": "7"})
    assert (only_omp.threads, only_omp.cpus) == (7, None)
    default = ct.plan_threads(None, environ={})
    assert (default.threads, default.cpus) == (min(len(ct.usable_cpus()), torch.get_num_threads()), None)
    before = torch.get_num_threads()
    try:  # a caller's own lower setting stands
        torch.set_num_threads(1)
        assert ct.plan_threads(None, environ={}).threads == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="cpu-threads"):
        ct.plan_threads(0, environ={})


@pytest.mark.parametrize("text", [",", "a,b", "-1", "1;2"])
def test_bad_cpu_list_names_the_variable(text):
    with pytest.raises(ValueError, match=ct.CPUS_ENV):
        ct.parse_cpus(text)


def test_children_get_disjoint_slices_of_the_parents_share():
    env = {ct.CPUS_ENV: "0,1,2,3,4,5"}
    replicas = [ct.child_env(r, 3, env)[ct.CPUS_ENV] for r in range(3)]
    assert replicas == ["0,1", "2,3", "4,5"]
    # a replica's own TP ranks split its slice again
    inner = [ct.child_env(r, 2, {ct.CPUS_ENV: replicas[1]})[ct.CPUS_ENV] for r in range(2)]
    assert inner == ["2", "3"]


needs_native = pytest.mark.skipif(native_library() is None, reason="no native CPU library (no C compiler)")
needs_two = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores to tell 1 thread from many")


@needs_native
@needs_two
def test_native_kernels_follow_the_plan_on_every_thread():
    """omp_set_num_threads would reach only the calling thread; the engine may step on another one
    (AsyncEngine's thread). The kernels' own setting reaches both."""
    lib = native_library()
    before = torch.get_num_threads()
    try:
        ct.apply_threads(ct.CpuThreads(1, None, "test"))
        assert torch.get_num_threads() == 1 and lib.tf_parallel_width() == 1
        seen = []
        t = threading.Thread(target=lambda: seen.append(lib.tf_parallel_width()))
        t.start()
        t.join()
        assert seen == [1]
        ct.apply_threads(ct.CpuThreads(2, None, "test"))
        assert lib.tf_parallel_width() == 2
    finally:
        lib.tf_set_num_threads(0)
        torch.set_num_threads(before)


@needs_native
def test_a_pinned_process_runs_on_its_slice():
    """TOKENFAB_CPUS from a launcher: the engine process pins itself and sizes both pools to it (in a
    child process: pinning this one would slow every later test)."""
    first = sorted(os.sched_getaffinity(0))[0]
    code = ("import json, os, torch; from tokenfab.engine.runner.cpu_threads import configure_engine_threads;"
            "from tokenfab.kernels.cpu import native_library; p = configure_engine_threads();"
            "print(json.dumps([sorted(os.sched_getaffinity(0)), torch.get_num_threads(),"
            " native_library().tf_parallel_width(), p.why]))")
    env = {**os.environ, ct.CPUS_ENV: str(first), "PYTHONPATH": str(ROOT)}
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    cpus, torch_threads, native_width, why = json.loads(out.stdout.strip().splitlines()[-1])
    assert cpus == [first] and torch_threads == 1 and native_width == 1 and ct.CPUS_ENV in why


@needs_native
@needs_two
def test_rank0_pinned_to_its_slice_still_hands_out_the_others():
    """TP rank 0 pins itself to slice 0 before it spawns its workers: the workers' slices come from the
    share it had before pinning, so they do not land on rank 0's cores (in a child process)."""
    code = ("import json; from tokenfab.engine.runner import cpu_threads as ct;"
            "p = ct.configure_engine_threads(None, (0, 2));"
            "print(json.dumps([list(p.cpus), ct.child_env(1, 2)[ct.CPUS_ENV]]))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop(ct.CPUS_ENV, None)
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    rank0, worker = json.loads(out.stdout.strip().splitlines()[-1])
    share = sorted(os.sched_getaffinity(0))
    assert rank0 == list(ct.split_cpus(share, 2)[0])
    assert [int(c) for c in worker.split(",")] == list(ct.split_cpus(share, 2)[1])
    assert not set(rank0) & {int(c) for c in worker.split(",")}


def test_engine_args_refuse_a_bad_thread_count():
    from tokenfab.engine.args import EngineArgs

    with pytest.raises(ValueError, match="cpu_threads"):
        EngineArgs(cpu_threads=0)


def test_engine_applies_its_plan(tiny_llama_dir):
    from tokenfab.engine.llm_engine import LLMEngine

    before = torch.get_num_threads()
    try:
        engine = LLMEngine(model=tiny_llama_dir, num_kv_blocks=16, block_size=4, cpu_threads=1)
        assert engine.cpu_threads == ct.CpuThreads(1, None, "--cpu-threads")
        assert torch.get_num_threads() == 1
        lib = native_library()
        if lib is not None:
            assert lib.tf_get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
        lib = native_library()
        if lib is not None:
            lib.tf_set_num_threads(0)
