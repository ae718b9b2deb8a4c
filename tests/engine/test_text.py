"""Text-level behaviour on the bundled model: stop strings, streaming deltas, UTF-8, chat, CLI."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from tokenfab import LLM, SamplingParams
from tokenfab.cli import main
from tokenfab.tokenizer import detokenize_incrementally


@pytest.fixture(scope="module")
def llm():
    return LLM()


def stream(llm, prompt, params):
    eng = llm.engine
    eng.add_request("s", prompt, params)
    deltas, last = [], None
    while eng.has_unfinished_requests():
        for out in eng.step():
            deltas.append(out.outputs[0].delta_text)
            last = out
    return deltas, last


def test_stop_string_is_not_emitted_and_deltas_add_up(llm):
    prompt = "List the numbers: 1, 2, 3, 4,"
    base = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=20))[0].outputs[0].text
    assert " 6" in base, base  # the model counts on
    stop = " 6"
    deltas, last = stream(llm, prompt, SamplingParams(temperature=0, max_tokens=20, stop=[stop]))
    text = last.outputs[0].text
    assert last.outputs[0].finish_reason == "stop" and last.outputs[0].stop_reason == stop
    assert text == base[: base.index(stop)]
    assert "".join(deltas) == text  # nothing of the stop string leaked into a delta


def test_incremental_detokenization_multibyte(llm):
    tok = llm.tokenizer
    text = "Emoji 🎉 and 東京 café — naïve ✓"
    ids = tok.encode(text)
    out, prefix, read = "", 0, 0
    for i in range(1, len(ids) + 1):
        delta, prefix, read = detokenize_incrementally(tok, ids[:i], prefix, read)
        assert "\ufffd" not in delta
        out += delta
    assert out == tok.decode(ids)


def test_streamed_text_equals_decode_of_tokens(llm):
    deltas, last = stream(llm, "Write a haiku about the sea in Japanese:",
                          SamplingParams(temperature=0.7, seed=3, max_tokens=40))
    c = last.outputs[0]
    assert "".join(deltas) == c.text
    assert c.text == llm.tokenizer.decode(c.token_ids, skip_special_tokens=True)


def test_chat_template_and_eos(llm):
    out = llm.chat([{"role": "user", "content": "What is the capital of France? Answer in one word."}],
                   SamplingParams(temperature=0, max_tokens=30))[0]
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop"  # ended on <|im_end|>
    assert out.outputs[0].stop_reason in llm.engine.eos_token_ids
    ids = out.prompt_token_ids
    assert llm.tokenizer.decode(ids).rstrip().endswith("<|im_start|>assistant")


def test_ignore_eos_runs_to_max_tokens(llm):
    p = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    out = llm.chat([{"role": "user", "content": "Say hi."}], p)[0]
    assert len(out.outputs[0].token_ids) == 40 and out.outputs[0].finish_reason == "length"


def test_prompt_longer_than_context_is_a_clear_error(llm):
    with pytest.raises(ValueError, match="context"):
        llm.generate([[1] * (llm.engine.max_model_len + 5)], SamplingParams(max_tokens=2))
    assert not llm.engine.has_unfinished_requests()


GENERATE = ["generate", "--prompt", "The capital of France is", "--max-tokens", "5", "--json"]
CHAT = ["chat", "--max-tokens", "12"]
CHAT_INPUT = "What is the capital of France?\n\n"


def check_generate(rc: int, stdout: str, stderr: str) -> None:
    assert rc == 0, stderr
    assert "Paris" in stdout


def check_chat(rc: int, stdout: str, stderr: str) -> None:
    assert rc == 0, stderr
    banner, _, reply = stdout.partition("> ")
    assert "tokenfab chat with SmolLM2-135M-Instruct" in banner
    assert "Paris" in reply


def test_cli_generate_in_process(capsys):
    """`tokenfab generate` through the CLI's own entry point (argument parsing, the engine it builds,
    the JSON lines), in this process; the `python -m tokenfab` process is the slow twin below."""
    rc = main(GENERATE)
    out = capsys.readouterr()
    check_generate(rc, out.out, out.err)


def test_cli_chat_in_process_streams_a_reply_and_quits_on_empty_line(capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(CHAT_INPUT))
    rc = main(CHAT)
    out = capsys.readouterr()
    check_chat(rc, out.out, out.err)


def run_cli(args: list[str], stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tokenfab", *args], input=stdin, capture_output=True, text=True,
                          timeout=300)


@pytest.mark.slow
def test_cli_generate():
    res = run_cli(GENERATE)
    check_generate(res.returncode, res.stdout, res.stderr)


@pytest.mark.slow
def test_cli_chat_streams_a_reply_and_quits_on_empty_line():
    res = run_cli(CHAT, CHAT_INPUT)
    check_chat(res.returncode, res.stdout, res.stderr)
