"""Vendor one version of a CRD's published OpenAPI schema as a small JSON file for the manifest tests.

    python deploy/kubernetes/schemas/vendor_crd.py CRD.yaml --version v1 --source URL --out NAME.json \
        [--opaque spec.leaderWorkerTemplate.leaderTemplate ...]

Descriptions are dropped (they are most of the bytes). Each ``--opaque`` path (dotted property names under
``openAPIV3Schema``) is replaced by ``{"type": "object", "x-kubernetes-preserve-unknown-fields": true}``: the
LeaderWorkerSet's pod templates are full core PodTemplateSpecs (1.3 MB of schema), which the tests validate
with kubernetes-validate instead. Nothing else is changed; ``x-source`` records where the schema came from.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import yaml


def strip_descriptions(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: strip_descriptions(v) for k, v in node.items() if k != "description"}
    if isinstance(node, list):
        return [strip_descriptions(v) for v in node]
    return node


def make_opaque(schema: dict[str, Any], dotted: str) -> None:
    node = schema
    parts = dotted.split(".")
    for part in parts[:-1]:
        node = node["properties"][part]
    node["properties"][parts[-1]] = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("crd", type=Path)
    p.add_argument("--version", required=True, help="the CRD version to keep (spec.versions[].name)")
    p.add_argument("--source", required=True, help="where the CRD file was taken from (URL at a tag)")
    p.add_argument("--commit", default="", help="the upstream commit of that tag")
    p.add_argument("--opaque", action="append", default=[], help="dotted property path to leave unchecked")
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    crd = yaml.safe_load(args.crd.read_text())
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == args.version]
    schema = strip_descriptions(version["schema"]["openAPIV3Schema"])
    for dotted in args.opaque:
        make_opaque(schema, dotted)
    out = {
        "x-source": {"url": args.source, "commit": args.commit, "crd": crd["metadata"]["name"],
                     "version": args.version, "opaque": args.opaque, "descriptions": "removed"},
        "group": crd["spec"]["group"], "kind": crd["spec"]["names"]["kind"], "version": args.version,
        "openAPIV3Schema": schema,
    }
    args.out.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
