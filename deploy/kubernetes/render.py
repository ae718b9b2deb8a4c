"""Render the manifests in this folder: substitute ``${KEY}`` from ``values.env`` (and ``--set KEY=VALUE``).

    python deploy/kubernetes/render.py                       # every manifest, default values
    python deploy/kubernetes/render.py --set IMAGE=my/tokenfab:1 --set REPLICAS=4 deployment.yaml

Only ``${UPPER_CASE}`` is replaced (the same placeholders ``envsubst`` replaces), so Kubernetes' own
``$(VAR)`` references in container args (``$(LWS_LEADER_ADDRESS)``) and Prometheus-adapter's ``${1}`` pass
through. A placeholder without a value, or a ``--set`` of a key that is not in values.env, is an error.
No Helm: helm is not available where this repository is built and tested, and a chart nobody can render
here would be unchecked; these files stay plain YAML, validated by tests/deploy/test_kubernetes_manifests.py.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
MANIFESTS = ("deployment.yaml", "hpa.yaml", "leaderworkerset.yaml", "inferencepool.yaml")
PLACEHOLDER = re.compile(r"\$\{([A-Z][A-Z0-9_]*)\}")


def read_values(path: Path = HERE / "values.env") -> dict[str, str]:
    """``KEY=VALUE`` lines; ``#`` lines and blank lines skipped."""
    values = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep or not re.fullmatch(r"[A-Z][A-Z0-9_]*", key):
            raise ValueError(f"{path.name}:{number}: expected KEY=VALUE, got {line!r}")
        values[key] = value
    return values


def substitute(text: str, values: dict[str, str], source: str = "<text>") -> str:
    missing = sorted({k for k in PLACEHOLDER.findall(text) if k not in values})
    if missing:
        raise KeyError(f"{source}: no value for {', '.join(missing)}")
    return PLACEHOLDER.sub(lambda m: values[m.group(1)], text)


def render(names: tuple[str, ...] | list[str] = MANIFESTS, overrides: dict[str, str] | None = None) -> str:
    """The chosen manifests, substituted, as one multi-document YAML text."""
    values = read_values()
    unknown = sorted(set(overrides or {}) - set(values))
    if unknown:
        raise KeyError(f"not in values.env: {', '.join(unknown)}")
    values.update(overrides or {})
    docs = [substitute((HERE / name).read_text(), values, name).strip() for name in names]
    return "\n---\n".join(docs) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="render tokenfab's Kubernetes manifests")
    p.add_argument("files", nargs="*", default=list(MANIFESTS), help=f"manifests (default: {' '.join(MANIFESTS)})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a value")
    args = p.parse_args(argv)
    overrides = dict(item.partition("=")[::2] for item in args.set)
    try:
        sys.stdout.write(render(args.files, overrides))
    except (KeyError, ValueError, OSError) as e:
        print(f"render.py: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
