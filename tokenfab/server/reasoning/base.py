"""The reasoning-parser interface: split a model's output into reasoning and content.

A parser is made per request (it knows whether the prompt already opened a think block and whether thinking
was switched off). `extract(text)` splits a whole output; `stream()` gives a `ReasoningStream` whose
`feed(delta)` returns `(kind, text)` pieces with kind ``"reasoning"`` or ``"content"`` and whose `finish()`
flushes what was held back (a possible partial tag). Concatenating the pieces of each kind over any split of
the text into deltas gives exactly `extract`'s result. Tool calls are parsed from the content only.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

REASONING = "reasoning"
CONTENT = "content"
Piece = tuple[str, str]


def join_pieces(pieces: list[Piece]) -> tuple[str | None, str | None]:
    """Concatenate streamed pieces by kind into `(reasoning, content)`, with None for an empty part."""
    reasoning = "".join(t for k, t in pieces if k == REASONING)
    content = "".join(t for k, t in pieces if k == CONTENT)
    return reasoning or None, content or None


class PieceBuffer:
    """Collects output pieces, merging neighbours of the same kind and dropping empty ones."""

    def __init__(self) -> None:
        self.pieces: list[Piece] = []

    def add(self, kind: str, text: str) -> None:
        if not text:
            return
        if self.pieces and self.pieces[-1][0] == kind:
            self.pieces[-1] = (kind, self.pieces[-1][1] + text)
        else:
            self.pieces.append((kind, text))

    def take(self) -> list[Piece]:
        out, self.pieces = self.pieces, []
        return out


class ReasoningStream(ABC):
    """Per-request streaming state."""

    @abstractmethod
    def feed(self, delta: str) -> list[Piece]:
        """Consume the next text delta; return the pieces that are now certain."""

    @abstractmethod
    def finish(self) -> list[Piece]:
        """End of output: return whatever was held back."""


class ReasoningParser(ABC):
    """Splits one request's output into `(reasoning, content)`."""

    name: str = ""

    @abstractmethod
    def extract(self, text: str) -> tuple[str | None, str | None]:
        """Split a complete output; a part that is empty is None."""

    @abstractmethod
    def stream(self) -> ReasoningStream:
        """A fresh streaming state for this request."""
