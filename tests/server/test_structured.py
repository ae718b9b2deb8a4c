"""The xgrammar-backed LogitsConstraint on the bundled model's tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from tokenfab.engine.runner.structured import GrammarConstraint, StructuredOutputCompiler, StructuredOutputError


@pytest.fixture(scope="module")
def compiler(served) -> StructuredOutputCompiler:
    return StructuredOutputCompiler(served.llm.tokenizer)


def _decode_constrained(constraint: GrammarConstraint, tokenizer, width: int, seed: int, limit: int = 200):
    """Sample from random logits under the constraint, as the engine would."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(limit):
        logits = torch.randn(width, generator=gen) * 3
        constraint.mask_logits(logits)
        assert torch.isfinite(logits).any()
        tok = int(torch.argmax(logits))
        constraint.accept_token(tok)
        if constraint.is_terminated():
            return tokenizer.decode(out), True
        out.append(tok)
    return tokenizer.decode(out), False


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}},
          "required": ["ok", "n"], "additionalProperties": False}


def test_schema_constraint_yields_valid_json_even_from_random_logits(compiler, served):
    tok = served.llm.tokenizer
    for seed in range(3):
        text, done = _decode_constrained(compiler.json_schema(SCHEMA), tok, len(tok), seed)
        assert done, text
        value = json.loads(text)
        assert set(value) == {"ok", "n"} and isinstance(value["ok"], bool) and 0 <= value["n"] <= 9
        assert compiler.json_schema(SCHEMA).num_rejected == 0


def test_model_vocab_wider_than_tokenizer_is_masked(compiler, served):
    tok = served.llm.tokenizer
    c = compiler.json_schema(SCHEMA)
    logits = torch.zeros(len(tok) + 64)
    logits[len(tok):] = 100.0  # padding ids would win if left unmasked
    c.mask_logits(logits)
    assert torch.isinf(logits[len(tok):]).all()
    assert tok.decode([int(torch.argmax(logits))]).strip().startswith("{")


def test_compiled_grammars_are_cached_and_clones_are_independent(compiler):
    a = compiler.json_schema(SCHEMA)
    b = compiler.json_schema(json.loads(json.dumps(SCHEMA)))  # equal schema, new dict
    assert a._compiled is b._compiled
    c = a.clone()
    a.accept_token(int(torch.argmax(_masked(a))))
    assert c._matcher is not a._matcher
    assert not c.is_terminated()


def _masked(c: GrammarConstraint) -> torch.Tensor:
    logits = torch.zeros(c._vocab)
    c.mask_logits(logits)
    return logits


def test_response_format_forms(compiler):
    assert compiler.from_response_format(None) is None
    assert compiler.from_response_format({"type": "text"}) is None
    assert isinstance(compiler.from_response_format({"type": "json_object"}), GrammarConstraint)
    rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA, "strict": True}}
    assert isinstance(compiler.from_response_format(rf), GrammarConstraint)
    with pytest.raises(StructuredOutputError):
        compiler.from_response_format({"type": "json_schema", "json_schema": {"name": "x"}})
    with pytest.raises(StructuredOutputError):
        compiler.json_schema({"type": "no-such-type"})
    with pytest.raises(StructuredOutputError):
        compiler.json_schema("{not json")
