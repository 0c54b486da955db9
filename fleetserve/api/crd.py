"""Generate the InferenceDeployment CustomResourceDefinition from the pydantic models.

The pydantic JSON schema is turned into a Kubernetes *structural* schema: `$ref`s are inlined,
`Optional[X]` (anyOf with null) becomes X, titles are dropped, every object gets `type: object`, and
non-optional nested objects default to `{}` so the API server fills their defaults in.
"""

from __future__ import annotations

from typing import Any

import yaml

from fleetserve.api.models import (
    GROUP,
    KIND,
    PLURAL,
    VERSION,
    InferenceDeploymentSpec,
    InferenceDeploymentStatus,
)

__all__ = ["CRD_FILENAME", "crd_manifest", "crd_yaml", "structural_schema"]

CRD_FILENAME = f"{PLURAL}.{GROUP}.yaml"

_KEEP = (
    "type",
    "description",
    "default",
    "enum",
    "minimum",
    "maximum",
    "minLength",
    "maxLength",
    "pattern",
    "x-kubernetes-validations",
)


def structural_schema(schema: dict[str, Any], defs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Convert one pydantic JSON schema node (with its `$defs`) into a structural schema node."""
    defs = defs if defs is not None else schema.get("$defs", {})
    if "$ref" in schema:
        target = defs[schema["$ref"].rsplit("/", 1)[-1]]
        merged = {**target, **{k: v for k, v in schema.items() if k != "$ref"}}
        return structural_schema(merged, defs)
    if "anyOf" in schema:
        options = [s for s in schema["anyOf"] if s.get("type") != "null"]
        assert len(options) == 1, f"only Optional[X] unions are supported, got {schema['anyOf']}"
        rest = {k: v for k, v in schema.items() if k != "anyOf"}
        if rest.get("default", 0) is None:
            del rest["default"]
        return structural_schema({**options[0], **rest}, defs)
    if "const" in schema:
        schema = {**schema, "enum": [schema["const"]]}
    out: dict[str, Any] = {k: schema[k] for k in _KEEP if k in schema}
    if "properties" in schema:
        out["type"] = "object"
        required = set(schema.get("required", []))
        props: dict[str, Any] = {}
        for name, sub in schema["properties"].items():
            node = structural_schema(sub, defs)
            # NOTE: `{}` defaults make the API server default the nested fields too.
            nested = node.get("type") == "object" and "properties" in node
            if nested and name not in required and "anyOf" not in sub and "default" not in node:
                node["default"] = {}
            props[name] = node
        out["properties"] = props
        if required:
            out["required"] = sorted(required)
    elif schema.get("type") == "object":
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            out["additionalProperties"] = structural_schema(extra, defs)
    if schema.get("type") == "array":
        out["items"] = structural_schema(schema.get("items", {}), defs)
    return out


def _printer_columns() -> list[dict[str, Any]]:
    def col(name: str, path: str, kind: str = "string", priority: int = 0) -> dict[str, Any]:
        c: dict[str, Any] = {"name": name, "type": kind, "jsonPath": path}
        if priority:
            c["priority"] = priority
        return c

    return [
        col("Phase", ".status.phase"),
        col("Ready", '.status.conditions[?(@.type=="Ready")].status'),
        col("Prefill", ".status.roles.prefill.readyReplicas", "integer"),
        col("Prefill-Want", ".spec.roles.prefill.replicas", "integer"),
        col("Decode", ".status.roles.decode.readyReplicas", "integer"),
        col("Decode-Want", ".spec.roles.decode.replicas", "integer"),
        col("Endpoint", ".status.endpoint", priority=1),
        col("Age", ".metadata.creationTimestamp", "date"),
    ]


def crd_manifest() -> dict[str, Any]:
    """The full CustomResourceDefinition object (apiextensions.k8s.io/v1)."""
    spec = structural_schema(InferenceDeploymentSpec.model_json_schema(by_alias=True))
    status = structural_schema(InferenceDeploymentStatus.model_json_schema(by_alias=True))
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": KIND,
                "listKind": f"{KIND}List",
                "plural": PLURAL,
                "singular": KIND.lower(),
                "shortNames": ["infd"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": _printer_columns(),
                    "schema": {
                        "openAPIV3Schema": {
                            "type": "object",
                            "required": ["spec"],
                            "properties": {
                                "apiVersion": {"type": "string"},
                                "kind": {"type": "string"},
                                "metadata": {"type": "object"},
                                "spec": spec,
                                "status": status,
                            },
                        }
                    },
                }
            ],
        },
    }


def crd_yaml() -> str:
    """The CRD as YAML text, exactly what `crds/` holds and `fleetserve crds` prints."""
    header = "# Generated by `fleetserve crds` from fleetserve/api/models.py — do not edit.\n"
    return header + yaml.safe_dump(crd_manifest(), sort_keys=False, width=100)
