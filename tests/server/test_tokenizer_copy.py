"""The server tokenizes in its own thread with its own tokenizer copy: the engine thread detokenizes
with the engine's, and one fast tokenizer used by two threads can fail with "Already borrowed"."""

from __future__ import annotations

from tokenfab.server.serving import OpenAIServer


def test_server_tokenizer_is_a_private_equal_copy(served):
    server = OpenAIServer(served.engine)
    try:
        ours, engines = server.tokenizer, served.engine.tokenizer
        assert ours is not engines
        assert type(ours) is type(engines)
        for text in ["The capital of France is", "naïve café ✓ 日本語", ""]:
            assert ours.encode(text) == engines.encode(text)
        assert ours.chat_template == engines.chat_template
    finally:
        server.close()
