"""The documentation: the mkdocs site builds with no warning, the README stays a short front door, and
docs/architecture.md draws exactly the import layers that pyproject.toml's contract declares."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
MKDOCS = Path(sys.executable).parent / "mkdocs"
README_MAX_LINES = 250


def _normalize(layer: str) -> str:
    return " ".join(layer.split())


def contract_layers() -> list[str]:
    """The `layers` contract of [tool.importlinter] in pyproject.toml, top to bottom."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = [c for c in config["tool"]["importlinter"]["contracts"] if c["type"] == "layers"]
    assert len(contracts) == 1, "expected one layers contract in pyproject.toml"
    return [_normalize(layer) for layer in contracts[0]["layers"]]


def diagram_layers() -> list[str]:
    """The boxes of the layer diagram in docs/architecture.md: `[ ... ]` lines between the markers."""
    text = ARCHITECTURE.read_text()
    match = re.search(r"<!-- layers:begin -->(.*?)<!-- layers:end -->", text, re.S)
    assert match, "docs/architecture.md lost its <!-- layers:begin --> ... <!-- layers:end --> markers"
    return [_normalize(box) for box in re.findall(r"^\s*\[ (.+?) \]\s*$", match.group(1), re.M)]


def test_layer_diagram_matches_the_import_contract() -> None:
    assert diagram_layers() == contract_layers()


def test_readme_is_a_short_front_door() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < README_MAX_LINES
    assert "make serve" in text and "make test" in text
    assert "../shared" not in text, "the README must not point outside the repository"
    assert "from tokenfab import LLM, SamplingParams" in text


def test_readme_links_resolve() -> None:
    for target in re.findall(r"\]\(([^)\s]+)\)", README.read_text()):
        if re.match(r"[a-z]+://|#|mailto:", target):
            continue
        path = target.split("#", 1)[0]
        assert (ROOT / path).exists(), f"README.md links to {target}, which does not exist"


def test_named_paths_exist() -> None:
    """Every repository path the docs name in backticks (tokenfab/..., tests/..., scripts/...,
    benchmarks/...) exists, so the pages follow the code when files move."""
    pages = [README, ROOT / "tokenfab" / "kernels" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    missing = []
    for page in pages:
        for path in re.findall(r"`((?:tokenfab|tests|scripts|benchmarks)/[\w./*{},-]+)", page.read_text()):
            if "*" in path or "{" in path:  # a pattern, not a path
                continue
            if not (ROOT / path.rstrip(".")).exists():
                missing.append(f"{page.relative_to(ROOT)}: {path}")
    assert not missing, "paths named in the docs that do not exist:\n" + "\n".join(missing)


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    assert MKDOCS.exists(), f"{MKDOCS} missing: install the dev extras (pip install -e '.[dev]')"
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    proc = subprocess.run(
        [str(MKDOCS), "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"), "--site-dir",
         str(tmp_path / "site")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, f"mkdocs build --strict failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "site" / "architecture" / "index.html").exists()
