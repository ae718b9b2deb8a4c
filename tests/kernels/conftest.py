"""Kernel tests: Triton kernels against their PyTorch references.

Without a GPU the kernels run in Triton's interpreter, which is chosen when triton is first
imported: TRITON_INTERPRET=1 is set here, before any test module imports tokenfab.kernels
(and so triton). A suite run that imports triton earlier must set it itself (tests/conftest.py
or the environment). With a GPU the same tests run the compiled kernels on CUDA tensors.
"""

from __future__ import annotations

import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from tests.kernels.hopper_harness import session_batch  # noqa: E402
from tokenfab.kernels._launch import interpreting, patch_interpreter_bf16  # noqa: E402

if interpreting():
    patch_interpreter_bf16()


@pytest.fixture(scope="session")
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


@pytest.fixture
def gen() -> torch.Generator:
    """A seeded CPU generator: every test draws fresh but reproducible inputs."""
    g = torch.Generator()
    g.manual_seed(1234)
    return g


@pytest.fixture(scope="session")
def hopper_batch(request, tmp_path_factory):
    """The Hopper (sm_90) compile records: every selected test's ``hopper_runs`` compiled in one
    subprocess and one pool (tests/kernels/hopper_harness.py: ``session_batch``)."""
    return session_batch(request, tmp_path_factory)
