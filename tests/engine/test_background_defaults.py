"""The background class's defaults (issue 27's isolation): "auto" caps background prefill at 16 tokens a step and
pauses background decodes while online work is pending on a CPU, and leaves both off on a GPU; the CLI spells both
ways (0: no cap; --background-decodes-while-online / --no-...); an engine on a CPU gets the caps in its scheduler;
bad values are refused before a model loads."""

from __future__ import annotations

import argparse

import pytest

from tests.tiny_models import save_tiny_model, tiny_config
from tokenfab.engine.args import CPU_BACKGROUND_MAX_PREFILL_TOKENS, EngineArgs, background_limits
from tokenfab.engine.llm_engine import LLMEngine


def _parse(argv: list[str]) -> EngineArgs:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    return EngineArgs.from_cli_args(parser.parse_args(argv))


def test_auto_is_capped_on_cpu_and_uncapped_on_gpu():
    args = EngineArgs()
    assert (args.background_decodes_while_online, args.background_max_prefill_tokens) == ("auto", "auto")
    assert CPU_BACKGROUND_MAX_PREFILL_TOKENS == 16
    assert background_limits(args, "cpu") == (False, 16)
    assert background_limits(args, "cuda") == (True, None)


@pytest.mark.parametrize("argv, cpu, cuda", [
    ([], (False, 16), (True, None)),
    (["--background-max-prefill-tokens", "0"], (False, None), (True, None)),
    (["--background-max-prefill-tokens", "32"], (False, 32), (True, 32)),
    (["--background-max-prefill-tokens", "auto"], (False, 16), (True, None)),
    (["--background-decodes-while-online"], (True, 16), (True, None)),
    (["--no-background-decodes-while-online"], (False, 16), (False, None)),
    (["--background-max-prefill-tokens", "0", "--background-decodes-while-online"], (True, None), (True, None)),
])
def test_cli_spellings(argv, cpu, cuda):
    args = _parse(argv)
    assert background_limits(args, "cpu") == cpu
    assert background_limits(args, "cuda") == cuda


@pytest.mark.parametrize("argv", [["--background-max-prefill-tokens", "-1"], ["--background-max-prefill-tokens", "x"]])
def test_cli_refuses_bad_caps(argv, capsys):
    with pytest.raises(SystemExit):
        _parse(argv)
    assert "background-max-prefill-tokens" in capsys.readouterr().err


@pytest.mark.parametrize("kw", [{"background_max_prefill_tokens": -1}, {"background_max_prefill_tokens": "16"},
                                {"background_max_prefill_tokens": True}, {"background_decodes_while_online": "yes"},
                                {"background_decodes_while_online": 1}])
def test_python_api_refuses_bad_values(kw):
    with pytest.raises(ValueError, match="background_"):
        EngineArgs(**kw)


def test_python_api_none_and_zero_mean_no_cap():
    assert background_limits(EngineArgs(background_max_prefill_tokens=None), "cpu") == (False, None)
    assert background_limits(EngineArgs(background_max_prefill_tokens=0), "cpu") == (False, None)
    assert background_limits(EngineArgs(background_decodes_while_online=True), "cpu") == (True, 16)


def test_cpu_engine_schedules_with_the_caps(tmp_path):
    save_tiny_model(tiny_config("llama"), tmp_path / "m")
    capped = LLMEngine(model=str(tmp_path / "m"), device="cpu", num_kv_blocks=16)
    assert capped.scheduler.background_max_prefill_tokens == 16
    assert capped.scheduler.background_decodes_while_online is False
    off = LLMEngine(model=str(tmp_path / "m"), device="cpu", num_kv_blocks=16, background_max_prefill_tokens=0,
                    background_decodes_while_online=True)
    assert off.scheduler.background_max_prefill_tokens is None
    assert off.scheduler.background_decodes_while_online is True
