"""The server driven the way lm-evaluation-harness's ``local-completions`` scores text
(``loglikelihood``): token-id prompts, ``echo: true``, ``logprobs: 1``, ``max_tokens`` 0 or 1,
``temperature`` 0; its prompt logprobs must equal transformers' float32 log-softmax on the bundled
model, and the "is greedy" test lm-eval runs on ``top_logprobs`` must agree with transformers'
argmax."""

from __future__ import annotations

import pytest
import torch

TOL = 1e-4
CONTEXTS = ["Question: What is the capital of France?\nAnswer:", "The quick brown fox", "1, 2, 3, 4,"]
CONTINUATIONS = [" Paris", " jumps over the lazy dog", " 5"]


@pytest.fixture(scope="module")
def hf_logprobs(hf_bundled):
    hf = hf_bundled  # the session's shared transformers copy of the bundled model (tests/conftest.py)

    def score(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].float()
        return torch.log_softmax(logits, -1)  # row i: the distribution of token i + 1

    return score


def _requests(tokenizer) -> list[tuple[list[int], int]]:
    out = []
    for ctx, cont in zip(CONTEXTS, CONTINUATIONS):
        c = tokenizer.encode(ctx)
        whole = tokenizer.encode(ctx + cont)
        out.append((whole, len(c)))
    return out


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_local_completions_loglikelihood_matches_transformers(served, http, hf_logprobs, max_tokens):
    reqs = _requests(served.llm.tokenizer)
    payload = {"model": served.model, "prompt": [ids for ids, _ in reqs], "echo": True, "logprobs": 1,
               "max_tokens": max_tokens, "temperature": 0, "seed": 1234}
    resp = http.post("/v1/completions", json=payload)
    assert resp.status_code == 200, resp.text
    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
    assert len(choices) == len(reqs)
    tok = served.llm.tokenizer
    for (ids, ctxlen), choice in zip(reqs, choices):
        lp = choice["logprobs"]
        assert len(lp["token_logprobs"]) == len(ids) + max_tokens
        assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
        ref = hf_logprobs(ids)
        want = torch.tensor([float(ref[i - 1, ids[i]]) for i in range(1, len(ids))])
        got = torch.tensor(lp["token_logprobs"][1:len(ids)], dtype=torch.float32)
        torch.testing.assert_close(got, want, atol=TOL, rtol=0)
        # lm-eval: sum over the continuation, and "greedy" = each continuation token is the argmax
        cont = slice(ctxlen, len(ids))
        assert sum(lp["token_logprobs"][cont]) == pytest.approx(float(want[ctxlen - 1:].sum()), abs=1e-3)
        for i in range(ctxlen, len(ids)):
            top = lp["top_logprobs"][i]
            best = int(ref[i - 1].argmax())
            assert max(top, key=top.get) == tok.decode([best])
        if max_tokens == 1:  # the one generated token is the greedy next token
            assert choice["text"].startswith(tok.decode(ids))
            assert lp["token_logprobs"][-1] == pytest.approx(float(hf_logprobs(ids)[-1].max()), abs=TOL)
        else:
            assert choice["finish_reason"] == "length"
            assert choice["text"] == tok.decode(ids)


def test_prompt_logprobs_extra_matches_transformers(served, http, hf_logprobs):
    ids, _ = _requests(served.llm.tokenizer)[0]
    resp = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 1, "temperature": 0,
                                              "prompt_logprobs": 3})
    assert resp.status_code == 200, resp.text
    plp = resp.json()["choices"][0]["prompt_logprobs"]
    ref = hf_logprobs(ids)
    assert plp[0] is None and len(plp) == len(ids)
    for i in range(1, len(ids)):
        entry = plp[i]
        assert abs(entry[str(ids[i])]["logprob"] - float(ref[i - 1, ids[i]])) < TOL
        top3 = torch.topk(ref[i - 1], 3).indices.tolist()
        ranked = {int(t): v["rank"] for t, v in entry.items()}
        for r, t in enumerate(top3, start=1):
            assert ranked.get(t) == r


@pytest.mark.parametrize("max_tokens", [0, 3])
def test_streamed_echo_logprobs_equal_non_streamed(served, http, max_tokens):
    import json

    ids, _ = _requests(served.llm.tokenizer)[1]
    body = {"prompt": ids, "echo": True, "logprobs": 2, "max_tokens": max_tokens, "temperature": 0}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    resp = http.post("/v1/completions", json={**body, "stream": True})
    events = [json.loads(line[6:]) for line in resp.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    text, token_logprobs = "", []
    for e in events:
        choice = e["choices"][0]
        text += choice["text"]
        if choice["logprobs"]:
            token_logprobs += choice["logprobs"]["token_logprobs"]
    assert text == whole["text"]
    assert token_logprobs == whole["logprobs"]["token_logprobs"]
    assert len(token_logprobs) == len(ids) + max_tokens
