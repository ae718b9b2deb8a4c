"""CPU engine set-up: packed weights (MKL float32, oneDNN bfloat16; same logits as unpacked) and
allocator tuning."""

from __future__ import annotations

import pytest
import torch

from tokenfab.engine.llm_engine import LLMEngine, tune_cpu_allocator
from tokenfab.engine.requests.sampling_params import SamplingParams
from tokenfab.engine.requests.sequence import Sequence
from tokenfab.layers.linear import PACKED_MAX_ROWS, Linear, mkl_packing_available, onednn_bf16_packing_available


def _logits(eng: LLMEngine, n_tokens: list[int]) -> torch.Tensor:
    seqs = [Sequence(f"s{i}", None, list(range(3, 3 + n)), SamplingParams(), 0) for i, n in enumerate(n_tokens)]
    for s in seqs:
        eng.block_manager.allocate(s, s.num_tokens)
    with torch.inference_mode():
        return eng.runner.execute(eng.runner.prepare(seqs, [s.num_tokens for s in seqs], [True] * len(seqs)))


@pytest.mark.skipif(not mkl_packing_available(), reason="torch built without MKL")
def test_packed_weights_give_the_same_logits(tiny_llama_dir):
    packed = LLMEngine(model=tiny_llama_dir, num_kv_blocks=64, block_size=4)
    plain = LLMEngine(model=tiny_llama_dir, num_kv_blocks=64, block_size=4, cpu_weight_packing=False)
    linears = [m for m in packed.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed_weight is not None for m in linears)
    assert packed.model.lm_head.packed_weight is not None
    assert all(m.packed_weight is None for m in plain.model.modules() if isinstance(m, Linear))
    torch.testing.assert_close(_logits(packed, [5, 1, 9]), _logits(plain, [5, 1, 9]), atol=1e-5, rtol=1e-5)


def test_packed_linear_matches_f_linear_on_both_sides_of_the_row_cutoff():
    if not mkl_packing_available():
        pytest.skip("torch built without MKL")
    from tokenfab.layers.linear import prepack_cpu_linears

    lin = Linear(48, 40, bias=True)
    torch.nn.init.normal_(lin.weight)
    torch.nn.init.normal_(lin.bias)
    assert prepack_cpu_linears(lin) == 48 * 40 * 4
    for rows in (1, 7, PACKED_MAX_ROWS, PACKED_MAX_ROWS + 1):
        x = torch.randn(rows, 48)
        torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias), atol=1e-4, rtol=1e-5)
    x3 = torch.randn(2, 3, 48)  # leading dims are flattened and restored
    torch.testing.assert_close(lin(x3), torch.nn.functional.linear(x3, lin.weight, lin.bias), atol=1e-4, rtol=1e-5)


@pytest.mark.skipif(not onednn_bf16_packing_available(), reason="torch without oneDNN bfloat16 on this CPU")
def test_bfloat16_packed_weights_give_identical_logits(tiny_llama_dir):
    packed = LLMEngine(model=tiny_llama_dir, num_kv_blocks=64, block_size=4, dtype="bfloat16")
    plain = LLMEngine(model=tiny_llama_dir, num_kv_blocks=64, block_size=4, dtype="bfloat16",
                      cpu_weight_packing=False)
    linears = [m for m in packed.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed_weight is not None for m in linears)
    assert packed.model.lm_head.packed_weight is not None
    # oneDNN runs the same kernels on the packed layout: the same numbers, bit for bit
    assert torch.equal(_logits(packed, [5, 1, 9]), _logits(plain, [5, 1, 9]))


@pytest.mark.skipif(not onednn_bf16_packing_available(), reason="torch without oneDNN bfloat16 on this CPU")
def test_bfloat16_packed_linear_equals_f_linear():
    from tokenfab.layers.linear import prepack_cpu_linears

    lin = Linear(48, 40, bias=True).to(torch.bfloat16)
    torch.nn.init.normal_(lin.weight)
    torch.nn.init.normal_(lin.bias)
    assert prepack_cpu_linears(lin) == 48 * 40 * 2
    for shape in ((1, 48), (64, 48), (2000, 48), (2, 3, 48)):
        x = torch.randn(*shape).to(torch.bfloat16)
        assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))
    x = torch.randn(5, 96).to(torch.bfloat16)[:, ::2]  # a strided input is made contiguous first
    assert torch.equal(lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias))


def test_allocator_tuning(monkeypatch):
    assert tune_cpu_allocator() is True  # glibc on this machine
    monkeypatch.setenv("TOKENFAB_CPU_MALLOC_TUNING", "0")
    assert tune_cpu_allocator() is False
