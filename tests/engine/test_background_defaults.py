"""The background class's defaults (issue 27's isolation): "auto" caps background prefill at 16 tokens a step,
pauses background decodes while online work is pending and caps background steps at 2 tokens per engine thread
while online traffic is present on a CPU, and leaves all three off on a GPU; the CLI spells each way (0: no cap;
--background-decodes-while-online / --no-...); an engine on a CPU gets the caps in its scheduler; bad values are
refused before a model loads."""

from __future__ import annotations

import argparse

import pytest

from tests.tiny_models import save_tiny_model, tiny_config
from tokenfab.engine.args import (
    BACKGROUND_TOKENS_PER_CPU_THREAD,
    CPU_BACKGROUND_MAX_PREFILL_TOKENS,
    EngineArgs,
    background_limits,
)
from tokenfab.engine.llm_engine import LLMEngine


def _parse(argv: list[str]) -> EngineArgs:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return EngineArgs.from_cli_args(parser.parse_args(argv))


def test_auto_is_capped_on_cpu_and_uncapped_on_gpu():
    args = EngineArgs()
    assert (
        args.background_decodes_while_online,
        args.background_max_prefill_tokens,
        args.background_max_tokens_while_online,
    ) == ("auto", "auto", "auto")
    assert CPU_BACKGROUND_MAX_PREFILL_TOKENS == 16 and BACKGROUND_TOKENS_PER_CPU_THREAD == 2
    assert background_limits(args, "cpu", cpu_threads=2) == (False, 16, 4)
    assert background_limits(args, "cuda", cpu_threads=2) == (True, None, None)


@pytest.mark.parametrize("threads, cap", [(1, 2), (2, 4), (16, 32)])
def test_the_auto_online_step_cap_follows_the_engine_threads(threads, cap):
    assert background_limits(EngineArgs(), "cpu", cpu_threads=threads)[2] == cap


def test_the_auto_online_step_cap_reads_torch_threads_when_not_told():
    import torch

    assert background_limits(EngineArgs(), "cpu")[2] == BACKGROUND_TOKENS_PER_CPU_THREAD * torch.get_num_threads()


@pytest.mark.parametrize(
    "argv, cpu, cuda",
    [
        ([], (False, 16, 4), (True, None, None)),
        (["--background-max-prefill-tokens", "0"], (False, None, 4), (True, None, None)),
        (["--background-max-prefill-tokens", "32"], (False, 32, 4), (True, 32, None)),
        (["--background-max-prefill-tokens", "auto"], (False, 16, 4), (True, None, None)),
        (["--background-decodes-while-online"], (True, 16, 4), (True, None, None)),
        (["--no-background-decodes-while-online"], (False, 16, 4), (False, None, None)),
        (
            ["--background-max-prefill-tokens", "0", "--background-decodes-while-online"],
            (True, None, 4),
            (True, None, None),
        ),
        (["--background-max-tokens-while-online", "0"], (False, 16, None), (True, None, None)),
        (["--background-max-tokens-while-online", "6"], (False, 16, 6), (True, None, 6)),
        (["--background-max-tokens-while-online", "auto"], (False, 16, 4), (True, None, None)),
    ],
)
def test_cli_spellings(argv, cpu, cuda):
    args = _parse(argv)
    assert background_limits(args, "cpu", cpu_threads=2) == cpu
    assert background_limits(args, "cuda", cpu_threads=2) == cuda


@pytest.mark.parametrize("flag", ["--background-max-prefill-tokens", "--background-max-tokens-while-online"])
@pytest.mark.parametrize("value", ["-1", "x", "1.5"])
def test_cli_refuses_bad_caps(flag, value, capsys):
    with pytest.raises(SystemExit):
        _parse([flag, value])
    err = capsys.readouterr().err
    assert flag in err and repr(value) in err


@pytest.mark.parametrize(
    "kw",
    [
        {"background_max_prefill_tokens": -1},
        {"background_max_prefill_tokens": "16"},
        {"background_max_prefill_tokens": True},
        {"background_decodes_while_online": "yes"},
        {"background_decodes_while_online": 1},
        {"background_max_tokens_while_online": -2},
        {"background_max_tokens_while_online": "4"},
        {"background_max_tokens_while_online": 2.5},
        {"background_max_tokens_while_online": False},
    ],
)
def test_python_api_refuses_bad_values(kw):
    with pytest.raises(ValueError, match=next(iter(kw))):
        EngineArgs(**kw)


def test_python_api_none_and_zero_mean_no_cap():
    assert background_limits(EngineArgs(background_max_prefill_tokens=None), "cpu", 2) == (False, None, 4)
    assert background_limits(EngineArgs(background_max_prefill_tokens=0), "cpu", 2) == (False, None, 4)
    assert background_limits(EngineArgs(background_decodes_while_online=True), "cpu", 2) == (True, 16, 4)
    assert background_limits(EngineArgs(background_max_tokens_while_online=None), "cpu", 2) == (False, 16, None)
    assert background_limits(EngineArgs(background_max_tokens_while_online=0), "cpu", 2) == (False, 16, None)


def test_cpu_engine_schedules_with_the_caps(tmp_path):
    import torch

    save_tiny_model(tiny_config("llama"), tmp_path / "m")
    capped = LLMEngine(model=str(tmp_path / "m"), device="cpu", num_kv_blocks=16)
    assert capped.scheduler.background_max_prefill_tokens == 16
    assert capped.scheduler.background_decodes_while_online is False
    assert capped.scheduler.background_max_tokens_while_online == 2 * torch.get_num_threads()
    off = LLMEngine(
        model=str(tmp_path / "m"),
        device="cpu",
        num_kv_blocks=16,
        background_max_prefill_tokens=0,
        background_decodes_while_online=True,
        background_max_tokens_while_online=0,
    )
    assert off.scheduler.background_max_prefill_tokens is None
    assert off.scheduler.background_decodes_while_online is True
    assert off.scheduler.background_max_tokens_while_online is None
