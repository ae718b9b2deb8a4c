"""One varied prompt set (code, prose, French, numbers, Japanese, two chats) shared by the packed-GGUF
drift bench (``bench/packed.py``) and the bundled model's greedy check against transformers
(``tests/models/test_bundled_vs_transformers.py``), so that both measure the same prompts."""

from __future__ import annotations

TEXT_PROMPTS = [
    "The capital of France is",
    "def quicksort(arr):",
    "Once upon a time, in a small village by the sea,",
    "Les mathématiques sont",
    "1, 1, 2, 3, 5, 8,",
    "東京は日本の首都です。",
]
CHATS = [
    [{"role": "user", "content": "Give me three tips for writing clear emails."}],
    [{"role": "system", "content": "You are a terse assistant."},
     {"role": "user", "content": "What is the boiling point of water in Fahrenheit?"}],
]
