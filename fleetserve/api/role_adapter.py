"""`InferenceDeploymentRole`: one role of an InferenceDeployment behind a `scale` subresource.

A custom resource can expose only one scale subresource, and an InferenceDeployment has two
roles to scale independently, so the operator creates one small adapter object per role (the
design DisaggregatedSet's RoleScaler, Dynamo's DGDSA and RBG's scaling adapter share). HPA, KEDA
or `kubectl scale infdrole/NAME-prefill --replicas N` write its `spec.replicas`; the operator
carries that into the deployment's `spec.roles.<role>.replicas` (and the other way when someone
edits the deployment), so the deployment stays the one description of what runs. `status.selector`
selects the role's group leaders (pod 0 of each group), the pods whose metrics describe a group.

The schema is small and fixed, so it is written here rather than generated from a model.
"""

from __future__ import annotations

from typing import Any

import yaml

from fleetserve.api.labels import LABEL_DEPLOYMENT, LABEL_POD_INDEX, LABEL_ROLE
from fleetserve.api.models import GROUP, VERSION

__all__ = [
    "ROLE_CRD_FILENAME",
    "ROLE_KIND",
    "ROLE_PLURAL",
    "role_adapter_name",
    "role_crd_manifest",
    "role_crd_yaml",
    "role_leader_selector",
]

ROLE_KIND = "InferenceDeploymentRole"
ROLE_PLURAL = "inferencedeploymentroles"
ROLE_CRD_FILENAME = f"{ROLE_PLURAL}.{GROUP}.yaml"


def role_adapter_name(deployment: str, role: str) -> str:
    return f"{deployment}-{role}"


def role_leader_selector(deployment: str, role: str) -> str:
    """The label selector of a role's group leaders (the scale subresource's selector)."""
    return f"{LABEL_DEPLOYMENT}={deployment},{LABEL_ROLE}={role},{LABEL_POD_INDEX}=0"


def _schema() -> dict[str, Any]:
    replicas = {"type": "integer", "minimum": 0, "description": "replica groups of the role"}
    return {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": {"type": "object"},
            "spec": {
                "type": "object",
                "required": ["deployment", "role", "replicas"],
                "properties": {
                    "deployment": {
                        "type": "string",
                        "description": "the InferenceDeployment (same namespace)",
                        "x-kubernetes-validations": [
                            {"rule": "self == oldSelf", "message": "deployment is immutable"}
                        ],
                    },
                    "role": {
                        "type": "string",
                        "enum": ["prefill", "decode", "unified"],
                        "x-kubernetes-validations": [
                            {"rule": "self == oldSelf", "message": "role is immutable"}
                        ],
                    },
                    "replicas": replicas,
                },
            },
            "status": {
                "type": "object",
                "properties": {
                    "replicas": {**replicas, "description": "ready groups of the role"},
                    "selector": {"type": "string", "description": "the role's group leaders"},
                    "observedReplicas": {
                        **replicas,
                        "description": "the replicas the deployment and this object last agreed on",
                    },
                    "autoscaled": {
                        "type": "boolean",
                        "description": "the deployment's own autoscaler drives the role (a scale"
                        " here is then undone)",
                    },
                },
            },
        },
    }


def role_crd_manifest() -> dict[str, Any]:
    """The InferenceDeploymentRole CustomResourceDefinition (apiextensions.k8s.io/v1)."""
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{ROLE_PLURAL}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced",
            "names": {
                "kind": ROLE_KIND,
                "listKind": f"{ROLE_KIND}List",
                "plural": ROLE_PLURAL,
                "singular": ROLE_KIND.lower(),
                "shortNames": ["infdrole"],
            },
            "versions": [
                {
                    "name": VERSION,
                    "served": True,
                    "storage": True,
                    "subresources": {
                        "status": {},
                        "scale": {
                            "specReplicasPath": ".spec.replicas",
                            "statusReplicasPath": ".status.replicas",
                            "labelSelectorPath": ".status.selector",
                        },
                    },
                    "additionalPrinterColumns": [
                        {"name": "Deployment", "type": "string", "jsonPath": ".spec.deployment"},
                        {"name": "Role", "type": "string", "jsonPath": ".spec.role"},
                        {"name": "Want", "type": "integer", "jsonPath": ".spec.replicas"},
                        {"name": "Ready", "type": "integer", "jsonPath": ".status.replicas"},
                        {"name": "Autoscaled", "type": "boolean", "jsonPath": ".status.autoscaled"},
                    ],
                    "schema": {"openAPIV3Schema": _schema()},
                }
            ],
        },
    }


def role_crd_yaml() -> str:
    """The adapter CRD as YAML text, exactly what `crds/` holds (`fleetserve crds --role-adapter`)."""
    header = "# Generated by `fleetserve crds --role-adapter` (fleetserve/api/role_adapter.py) — do not edit.\n"
    return header + yaml.safe_dump(role_crd_manifest(), sort_keys=False, width=100)
