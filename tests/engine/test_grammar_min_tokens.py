"""A grammar that is complete allows only EOS, which ``min_tokens`` bans: the grammar wins, the
request ends there, and no token outside the grammar is ever drawn (the row must not go all -inf)."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_failures import make_engine, run
from tokenfab.engine.requests.sampling_params import SamplingParams


class ScriptedGrammar:
    """Allows exactly ``script`` then EOS; records every token it is asked to accept."""

    def __init__(self, script: list[int], eos: int) -> None:
        self.script, self.eos, self.accepted, self.done = script, eos, [], False

    def _allowed(self) -> int:
        n = len(self.accepted)
        return self.script[n] if n < len(self.script) else self.eos

    def mask_logits(self, logits: torch.Tensor) -> None:
        keep = logits[self._allowed()].clone()
        logits.fill_(float("-inf"))
        logits[self._allowed()] = keep

    def accept_token(self, token_id: int) -> None:
        assert token_id == self._allowed(), f"grammar rejected token {token_id}"
        self.accepted.append(token_id)
        self.done = token_id == self.eos

    def is_terminated(self) -> bool:
        return self.done


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_complete_grammar_ends_the_request_despite_min_tokens(tiny_llama_dir, temperature):
    engine = make_engine(tiny_llama_dir)
    eos = engine.eos_token_ids[0]
    grammar = ScriptedGrammar([11, 12], eos)
    params = SamplingParams(temperature=temperature, max_tokens=10, min_tokens=6, seed=1, constraint=grammar)
    plain = SamplingParams(temperature=0, max_tokens=5, min_tokens=3)
    done = run(engine, {"g": ([5, 6, 7], params), "other": ([8, 9, 10, 11], plain)})
    out = done["g"].outputs[0]
    assert grammar.accepted == [11, 12, eos]
    assert out.token_ids == [11, 12, eos] and out.finish_reason == "stop" and done["g"].error is None
    assert len(done["other"].outputs[0].token_ids) >= 3  # min_tokens still holds for the request without a grammar
    assert engine.block_manager.num_used_blocks == 0
