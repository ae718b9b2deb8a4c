"""Errors raised while reading model files."""

from __future__ import annotations

from pathlib import Path


class ModelLoadError(ValueError):
    """A model file or directory cannot be loaded; the message names the file and the problem."""

    def __init__(self, path: str | Path, problem: str) -> None:
        self.path = str(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")
