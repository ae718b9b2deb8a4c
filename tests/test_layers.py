"""The import layers declared in pyproject.toml ([tool.importlinter]) are kept, and the check is real.

* ``lint-imports`` passes on the repository: every package imports only itself and the layers below
  it, and no two sibling modules of a package import each other (directly or through others).
* In a copy of the package, a planted upward import (kernels -> server) and a planted cycle between
  two sibling modules each fail the check, and the report names them: the contracts catch what they
  claim to.
* Every module of tokenfab lies in exactly one layer, so a new module cannot slip outside them.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "tokenfab"

# The .venv's import-linter, run by this interpreter (its console script would put .venv/bin, not
# the checked tree, first on sys.path); the cache is off so that nothing is written into the tree.
_LINT = "import sys; from importlinter.cli import lint_imports_command; sys.argv[0] = 'lint-imports'; " \
        "lint_imports_command()"


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    """``lint-imports`` on the tokenfab package and pyproject.toml of ``tree`` (cwd and PYTHONPATH)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([sys.executable, "-c", _LINT, "--no-cache", "--no-logo"], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300)


def _report(result: subprocess.CompletedProcess) -> str:
    return result.stdout + result.stderr


def _layers() -> list[list[str]]:
    """The layers contract, top to bottom: each layer as the list of its modules (``|`` or ``:``)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]
    (contract,) = [c for c in config["contracts"] if c["type"] == "layers"]
    return [[name.strip() for name in re.split(r"[|:]", layer)] for layer in contract["layers"]]


def _copy_tree(dst: Path) -> Path:
    shutil.copytree(ROOT / PACKAGE, dst / PACKAGE, ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    shutil.copy(ROOT / "pyproject.toml", dst / "pyproject.toml")
    return dst


def _append(path: Path, line: str) -> None:
    path.write_text(path.read_text() + f"\n{line}\n")


def test_contracts_kept():
    result = lint_imports(ROOT)
    report = _report(result)
    assert "Contracts: 2 kept, 0 broken." in report and result.returncode == 0, report


def test_planted_upward_import_breaks_the_layers(tmp_path):
    tree = _copy_tree(tmp_path)
    _append(tree / PACKAGE / "kernels" / "_dispatch.py", "import tokenfab.server  # planted: kernels -> server")
    result = lint_imports(tree)
    report = _report(result)
    assert result.returncode != 0, report
    assert "tokenfab.kernels is not allowed to import tokenfab.server" in report, report
    assert re.search(r"- tokenfab\.kernels\._dispatch -> tokenfab\.server \(l\.\d+\)", report), report


def test_planted_sibling_cycle_breaks_acyclic_siblings(tmp_path):
    tree = _copy_tree(tmp_path)
    loader = tree / PACKAGE / "loader"
    (loader / "planted_a.py").write_text("import tokenfab.loader.planted_b  # noqa: F401\n")
    (loader / "planted_b.py").write_text("import tokenfab.loader.planted_a  # noqa: F401\n")
    result = lint_imports(tree)
    report = _report(result)
    assert result.returncode != 0, report
    section = report.partition("No cycles are allowed in tokenfab.loader.")[2].split("No cycles are allowed")[0]
    assert re.search(r"- \.planted_[ab] -> \.planted_[ab] \(1 import\)", section), report


def test_every_module_lies_in_exactly_one_layer():
    layers = _layers()
    graph = grimp.build_graph(PACKAGE, cache_dir=None)
    entries = [name for layer in layers for name in layer]

    def layers_of(module: str) -> list[int]:
        return [i for i, layer in enumerate(layers)
                if any(module == name or module.startswith(name + ".") for name in layer)]

    outside, twice = [], []
    for module in sorted(graph.modules):
        found = layers_of(module)
        if len(found) > 1:
            twice.append(f"{module}: layers {found}")
        elif not found and module != PACKAGE:
            # a package split across layers (tokenfab.engine) is only their container: it may hold no code
            # that imports tokenfab, or that code would sit outside every layer
            container = any(name.startswith(module + ".") for name in entries)
            if not container or graph.find_modules_directly_imported_by(module):
                outside.append(module)
    assert not outside, f"modules in no layer of pyproject.toml's layers contract: {outside}"
    assert not twice, f"modules in more than one layer: {twice}"


def test_no_source_file_over_400_lines():
    """One concept a file (issue 25): no Python or C source of the package over 400 lines."""
    sources = [p for ext in ("*.py", "*.c", "*.h") for p in (ROOT / "tokenfab").rglob(ext)]
    assert len(sources) > 100
    long = {str(p.relative_to(ROOT)): n for p in sources if (n := len(p.read_text().splitlines())) > 400}
    assert not long, f"over 400 lines: {long}"
