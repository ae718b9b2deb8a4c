import os

# Tests run the engine on CPU; keep torch from oversubscribing the 2 cores of CI machines.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _subnormals_work() -> bool:
    import numpy as np

    return bool(np.float32(1e-39) * np.float32(1.0) != 0)


def pytest_runtest_teardown(item) -> None:
    """A shared library linked with -ffast-math (crtfastmath.o) flushes denormals to zero in the whole
    process, which silently changes every later test's numerics: name the test that did it."""
    if not _subnormals_work():
        raise RuntimeError(f"{item.nodeid} left the process flushing denormals to zero (a -ffast-math link?)")
