"""The Kubernetes manifests of deploy/kubernetes, rendered with their default values, and the checks the
tests share: kubernetes-validate for core objects, the vendored CRD schemas (jsonschema) for the rest."""

from __future__ import annotations

import copy
import importlib.util
import json
from pathlib import Path
from typing import Any

import jsonschema
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
SCHEMAS = DEPLOY / "schemas"
CRD_SCHEMAS = {  # apiVersion, kind -> the vendored schema file
    ("leaderworkerset.x-k8s.io/v1", "LeaderWorkerSet"): "leaderworkerset-v0.10.0.json",
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.6.0.json",
}
_spec = importlib.util.spec_from_file_location("tokenfab_k8s_render", DEPLOY / "render.py")
render_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render_module)


def objects(names: tuple[str, ...] = render_module.MANIFESTS, **overrides: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(render_module.render(names, overrides)) if d]


def values() -> dict[str, str]:
    return render_module.read_values()


def find(docs: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def closed(schema: Any) -> Any:
    """The schema with ``additionalProperties: false`` on every object that lists its properties: the API
    server prunes unknown fields of a CRD silently, so a misspelt field would be lost, not refused."""
    schema = copy.deepcopy(schema)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if ("properties" in node and "additionalProperties" not in node
                    and not node.get("x-kubernetes-preserve-unknown-fields")):
                node["additionalProperties"] = False
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(schema)
    return schema


def crd_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    vendored = json.loads((SCHEMAS / CRD_SCHEMAS[(api_version, kind)]).read_text())
    assert f"{vendored['group']}/{vendored['version']}" == api_version and vendored["kind"] == kind
    schema = closed(vendored["openAPIV3Schema"])
    schema["properties"]["metadata"] = {"$ref": "#/$defs/metadata"}
    schema["$defs"] = {"metadata": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", "maxLength": 63},
        "labels": {"type": "object", "additionalProperties": {"type": "string"}}}, "additionalProperties": False}}
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft7Validator)
    cls.check_schema(schema)
    return cls(schema)
