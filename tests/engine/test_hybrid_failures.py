"""A failing request beside hybrid-cache sequences (issue 29): the batched forward raises after the recurrent
layer has already advanced every sequence's state, so the retry of each sequence alone must not apply the
chunk a second time (runner/isolation.py retries such sequences from position 0). The others' greedy tokens
equal the from-scratch reference, the bad request fails alone, every block and slot comes back."""

from __future__ import annotations

import pytest

from tests.engine import hybrid_toy
from tests.engine.test_hybrid_cache import GREEDY, N_TOKENS, engine, make_prompts
from tokenfab.engine.runner import isolation

POISON = 311  # a batch holding this token raises in the second layer, after the first layer's state update


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("toy-hybrid-failures")
    hybrid_toy.save_toy_hybrid(path)
    return path


def poison_second_layer(monkeypatch, eng) -> None:
    layer = eng.runner.model.model.layers[1]
    inner = layer.forward

    def forward(x, residual, batch):
        if bool((batch.input_ids == POISON).any()):
            raise RuntimeError("kernel blew up")
        return inner(x, residual, batch)

    monkeypatch.setattr(layer, "forward", forward)


def run_with_late_poison(eng, prompts: list[list[int]], poison_at: int) -> dict:
    """Every prompt at step 0; the poisoned request joins at step ``poison_at`` (the others mid-decode)."""
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, GREEDY)
    done, step = {}, 0
    while eng.has_unfinished_requests():
        if step == poison_at:
            eng.add_request("bad", [4, POISON, 6], GREEDY)
        for out in eng.step():
            if out.finished:
                done[out.request_id] = out
        step += 1
    return done


@pytest.mark.parametrize("budget", [2048, 16])  # whole prompts; 16-token chunks (a chunk mid-prompt fails too)
def test_failure_beside_hybrid_sequences_leaves_them_exact(toy_dir, monkeypatch, budget):
    prompts = make_prompts(3, seed=7, lo=20, hi=40)
    expected = hybrid_toy.reference_greedy(toy_dir, prompts, N_TOKENS)
    eng = engine(toy_dir, max_num_batched_tokens=budget)
    poison_second_layer(monkeypatch, eng)
    done = run_with_late_poison(eng, prompts, poison_at=2)
    assert done["bad"].outputs[0].finish_reason == "error" and "kernel blew up" in done["bad"].error
    assert [done[f"r{i}"].outputs[0].token_ids for i in range(3)] == expected
    bm = eng.block_manager
    assert bm.num_free_blocks == bm.num_blocks and bm.state_slots.num_free == bm.state_slots.num_slots


def test_retrying_on_the_advanced_state_would_be_caught(toy_dir, monkeypatch):
    """Negative control: retried from where they stood (as for a pure-KV model), the others' tokens change."""
    prompts = make_prompts(3, seed=7, lo=20, hi=40)
    expected = hybrid_toy.reference_greedy(toy_dir, prompts, N_TOKENS)
    eng = engine(toy_dir)

    def alone_as_if_stateless(runner, execute, seq, n, sample, rows):
        return execute(runner.prepare([seq], [n], [sample], rows), [seq], [n])

    monkeypatch.setattr(isolation, "_forward_alone", alone_as_if_stateless)
    poison_second_layer(monkeypatch, eng)
    done = run_with_late_poison(eng, prompts, poison_at=2)
    assert [done[f"r{i}"].outputs[0].token_ids for i in range(3)] != expected


def test_pd_transfer_is_refused_for_a_hybrid_model(toy_dir):
    """P/D moves paged KV blocks only: a model with recurrent state is refused at start, not served wrong."""
    cfg = '{"kv_connector": "NixlConnector", "kv_role": "kv_consumer", "kv_port": 29911}'
    with pytest.raises(ValueError, match="recurrent-state layers"):
        engine(toy_dir, kv_transfer_config=cfg)
