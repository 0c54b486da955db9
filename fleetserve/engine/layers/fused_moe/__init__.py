"""Mixture-of-experts layer: routing, the torch and Triton expert paths, expert parallelism."""

from fleetserve.engine.layers.fused_moe.layer import MOE_BACKENDS, EplbMaps, FusedMoE
from fleetserve.engine.layers.fused_moe.routing import RoutingConfig, select_experts

__all__ = ["MOE_BACKENDS", "EplbMaps", "FusedMoE", "RoutingConfig", "select_experts"]
