"""The InferenceDeployment contract: models, CRD generation and rank layout (no torch, no kopf)."""

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
