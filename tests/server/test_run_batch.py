"""`tokenfab run-batch -i in.jsonl -o out.jsonl`: OpenAI batch lines run offline through the online handlers (the
same LineRunner as /v1/batches): greedy output equal to `LLM.chat`, lines in input order, a body the endpoint
rejects written with its 4xx status and error body; a bad input file refused with the bad line's number."""

from __future__ import annotations

import json

from tokenfab import SamplingParams
from tokenfab.cli import main

ENGINE = ["--max-model-len", "512", "--num-kv-blocks", "64"]


def _line(custom_id: str, url: str, body: dict) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}) + "\n"


def test_run_batch_writes_one_output_line_per_request(tmp_path, served, capsys):
    chat = [{"role": "user", "content": "Name a primary color."}]
    src = tmp_path / "in.jsonl"
    src.write_text(_line("chat", "/v1/chat/completions", {"messages": chat, "max_tokens": 8, "temperature": 0})
                   + _line("text", "/v1/completions", {"prompt": "The capital of France is", "max_tokens": 6,
                                                        "temperature": 0})
                   + _line("bad", "/v1/chat/completions", {"messages": chat, "max_tokens": -1}))
    out = tmp_path / "out.jsonl"
    assert main(["run-batch", "-i", str(src), "-o", str(out), *ENGINE]) == 0
    assert "3 lines, 2 succeeded, 1 failed" in capsys.readouterr().out
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["custom_id"] for x in lines] == ["chat", "text", "bad"]
    expected = served.llm.chat(chat, SamplingParams(temperature=0.0, max_tokens=8))[0].outputs[0].text
    assert lines[0]["response"]["body"]["choices"][0]["message"]["content"] == expected
    assert lines[1]["response"]["status_code"] == 200 and lines[1]["response"]["body"]["object"] == "text_completion"
    assert lines[2]["response"]["status_code"] == 400
    assert lines[2]["response"]["body"]["error"]["param"] == "max_tokens"


def test_run_batch_refuses_a_bad_file_by_line_number(tmp_path, capsys):
    src = tmp_path / "in.jsonl"
    src.write_text(_line("a", "/v1/completions", {"prompt": "x"}) + "not json\n"
                   + _line("a", "/v1/completions", {"prompt": "y"}) + _line("b", "/v1/embeddings", {}))
    assert main(["run-batch", "-i", str(src), "-o", str(tmp_path / "out.jsonl"), *ENGINE]) == 1
    err = capsys.readouterr().err
    assert "Line 2 is not valid JSON" in err and "Line 3: custom_id 'a' is not unique" in err
    assert "Line 4: url '/v1/embeddings'" in err
    assert not (tmp_path / "out.jsonl").exists()
