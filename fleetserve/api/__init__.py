"""The InferenceDeployment contract (no torch, no kopf).

Models and CRD generation, the rank layout, the KV compatibility hash, the children's label keys
(`labels`) and the router's config (`router_config`): what the operator, the router and the
engine share.
"""

from __future__ import annotations

from fleetserve.api.models import InferenceDeploymentSpec, InferenceDeploymentStatus
from fleetserve.api.topology import RankLayout, group_size, rank_layout

__all__ = [
    "InferenceDeploymentSpec",
    "InferenceDeploymentStatus",
    "RankLayout",
    "group_size",
    "rank_layout",
]
