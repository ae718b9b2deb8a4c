"""The one kernel rule (``kernels/_dispatch.py``): ``TOKENFAB_KERNELS=torch`` runs only the PyTorch
references (no Triton launch, no C kernel) through whole engine steps, ``triton`` launches the Triton
kernels, and the default runs the C kernels on CPU where they exist."""

from __future__ import annotations

import sys

import pytest
import torch

from tests.models.test_deepseek_dsa import save_tiny_dsa
from tests.tiny_models import save_tiny_model, tiny_config
from tokenfab.engine.llm_engine import LLMEngine
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.kernels import _dispatch


class Calls:
    """Records Triton launches and C-kernel library lookups; ``forbid`` turns either into an error."""

    def __init__(self, monkeypatch, forbid_triton: bool, forbid_native: bool) -> None:
        from triton.runtime.jit import KernelInterface

        self.triton: list[str] = []
        self.native = 0
        launch = KernelInterface.__getitem__

        def spy_launch(kernel, grid):
            name = getattr(kernel, "__name__", None) or kernel.fn.__name__
            self.triton.append(name)
            if forbid_triton:
                raise AssertionError(f"Triton kernel {name} launched")
            return launch(kernel, grid)

        monkeypatch.setattr(KernelInterface, "__getitem__", spy_launch)
        # every C-kernel wrapper gets the library through native_library() (kernels/cpu)
        for name, mod in list(sys.modules.items()):
            if name.startswith("tokenfab.kernels.cpu") and hasattr(mod, "native_library"):
                real = mod.native_library

                def spy_native(real=real):
                    self.native += 1
                    if forbid_native:
                        raise AssertionError("a C kernel was called")
                    return real()

                monkeypatch.setattr(mod, "native_library", spy_native)


def _steps(engine: LLMEngine, prompts: list[list[int]]) -> None:
    """A prefill step (greedy and sampled requests), then decode steps to the end."""
    engine.add_request("g", prompts[0], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    engine.add_request("s", prompts[1], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=3, ignore_eos=True,
                                                       seed=1))
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    # the engine contains a failing forward to its requests: surface it
    assert sorted(o.outputs[0].finish_reason for o in finished) == ["length", "length"]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama")
    save_tiny_model(tiny_config("llama"), path)
    return LLMEngine(model=str(path), block_size=4, num_kv_blocks=32, max_num_batched_tokens=64)


@pytest.fixture(scope="module")
def dsa(tmp_path_factory):
    path = tmp_path_factory.mktemp("dsa")
    save_tiny_dsa("glm_moe_dsa", path)
    return LLMEngine(model=str(path), block_size=4, num_kv_blocks=32, max_num_batched_tokens=64)


def test_backend_rule(monkeypatch):
    cpu = torch.zeros(1)
    monkeypatch.setenv("TOKENFAB_KERNELS", "torch")
    assert _dispatch.backend(cpu, native=True) == "reference"
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    assert _dispatch.backend(cpu, native=True) == "triton" and _dispatch.use_triton(cpu)
    monkeypatch.setenv("TOKENFAB_KERNELS", "auto")
    assert _dispatch.backend(cpu) == "reference"
    monkeypatch.setenv("TOKENFAB_CPU_NATIVE", "1")
    assert _dispatch.backend(cpu, native=True) == "native"
    monkeypatch.setenv("TOKENFAB_CPU_NATIVE", "0")
    assert _dispatch.backend(cpu, native=True) == "reference"
    monkeypatch.setenv("TOKENFAB_KERNELS", "cuda")
    with pytest.raises(ValueError, match="TOKENFAB_KERNELS"):
        _dispatch.backend(cpu)


@pytest.mark.parametrize("model", ["llama", "dsa"])
def test_torch_mode_runs_only_references(model, request, monkeypatch):
    """Norms, rope, activations, KV store, attention (paged, MLA, DSA), MoE, argmax, sampling."""
    engine = request.getfixturevalue(model)
    monkeypatch.setenv("TOKENFAB_KERNELS", "torch")
    calls = Calls(monkeypatch, forbid_triton=True, forbid_native=True)
    _steps(engine, [[5, 17, 42, 99, 3, 250, 7, 8], [1, 2, 3]])
    assert calls.triton == [] and calls.native == 0


def test_triton_mode_launches_triton_kernels(llama, monkeypatch):
    from tokenfab.kernels._launch import interpreting

    if not (torch.cuda.is_available() or interpreting()):
        pytest.skip("triton was imported without the interpreter")
    monkeypatch.setenv("TOKENFAB_KERNELS", "triton")
    calls = Calls(monkeypatch, forbid_triton=False, forbid_native=True)
    _steps(llama, [[5, 17, 42, 99, 3, 250, 7, 8], [1, 2, 3]])
    assert {"_rms_norm_kernel", "_rope_kernel", "_act_and_mul_kernel", "_store_kv_kernel", "_prefill_kernel",
            "_decode_split_kernel", "_sample_kernel"} <= set(calls.triton)
    assert calls.native == 0


def test_default_cpu_mode_runs_the_c_kernels(llama, monkeypatch):
    from tokenfab.kernels.cpu import native_library

    if native_library() is None:
        pytest.skip("no C compiler here: the C kernels are not built")
    monkeypatch.setenv("TOKENFAB_KERNELS", "auto")
    calls = Calls(monkeypatch, forbid_triton=True, forbid_native=False)
    _steps(llama, [[5, 17, 42, 99, 3, 250, 7, 8], [1, 2, 3]])
    assert calls.native > 0 and calls.triton == []
