import functools
import os

import pytest

# Tests run the engine on CPU; keep torch from oversubscribing the 2 cores of CI machines.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _subnormals_work() -> bool:
    import numpy as np

    return bool(np.float32(1e-39) * np.float32(1.0) != 0)


_AFFINITY = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
_THREADS: int | None = None  # torch's thread count when the first test started


def _restore_cpu_plan() -> None:
    """An engine built in this process on CPU applies its thread plan to the process
    (engine/runner/cpu_threads.py): with TP > 1 it pins it to rank 0's slice and sizes torch and the
    native kernels to it. Right for an engine process, but the rest of the suite would then run on
    that slice: give the test process its cores and thread counts back."""
    import sys

    import torch

    if _AFFINITY is not None and os.sched_getaffinity(0) != _AFFINITY:
        os.sched_setaffinity(0, _AFFINITY)
    if _THREADS is not None and torch.get_num_threads() != _THREADS:
        torch.set_num_threads(_THREADS)
    cpu = sys.modules.get("tokenfab.kernels.cpu")
    lib = getattr(cpu, "_library", None)
    if lib is not None:
        lib.tf_set_num_threads(0)


def pytest_runtest_setup(item) -> None:
    global _THREADS
    if _THREADS is None:
        import torch

        _THREADS = torch.get_num_threads()


def pytest_runtest_teardown(item) -> None:
    """A shared library linked with -ffast-math (crtfastmath.o) flushes denormals to zero in the whole
    process, which silently changes every later test's numerics: name the test that did it."""
    if not _subnormals_work():
        raise RuntimeError(f"{item.nodeid} left the process flushing denormals to zero (a -ffast-math link?)")
    _restore_cpu_plan()


@pytest.fixture(scope="session")
def hf_bundled():
    """transformers' own GGUF loading of the bundled SmolLM2 file (float32, eval), once per test
    session: loading it dequantizes the whole file in Python and was the largest single cost of
    the fast tier when each module that compares against it loaded its own copy. Read-only: tests
    run forwards and read weights, never modify it."""
    import importlib.util

    import gguf
    import torch
    import transformers
    import transformers.modeling_utils

    from tokenfab.loader.bundled import bundled_model_path

    path = bundled_model_path()
    with pytest.MonkeyPatch.context() as mp:
        if importlib.util.find_spec("accelerate") is None:
            # from_pretrained refuses GGUF files without `accelerate` installed, although loading
            # onto the CPU without a device_map never uses it.
            mp.setattr(transformers.modeling_utils, "is_accelerate_available", lambda: True)
        # transformers' GGUF loading builds gguf's TensorNameMap once per submodule (~400 times) and
        # parses the file's ~200k metadata values twice (config, then weights): both are pure, so
        # memoized for this one load (two thirds of its time); the weights are the same.
        mp.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
        mp.setattr(gguf, "GGUFReader", functools.lru_cache(maxsize=None)(gguf.GGUFReader))
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                                  dtype=torch.float32)
    return model.eval()
