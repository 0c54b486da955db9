"""What a simulated engine with EPLB reports as its balancedness (torch-free arithmetic).

A real engine's first EPLB window measures the load-time placement (physical slot p holds
logical expert p % E, slots p // (P / ranks) on each EP rank) under the model's skewed routing.
The simulation does that arithmetic for a Zipf-skewed load over `num_experts` experts, each
replica taking an equal share of its expert: mean ÷ max of the per-rank load, as
`fleetserve:eplb_balancedness` defines it. It models no rebalance (a simulated engine has no
weights to move); the operator only relays the figure.
"""

from __future__ import annotations

__all__ = ["SIM_NUM_EXPERTS", "SIM_ZIPF", "load_time_balancedness"]

SIM_NUM_EXPERTS = 64
SIM_ZIPF = 1.0


def load_time_balancedness(
    ep_size: int, redundant: int, num_experts: int = SIM_NUM_EXPERTS, zipf: float = SIM_ZIPF
) -> float:
    """Mean ÷ max per-rank load of the load-time placement under a Zipf(`zipf`) load.

    Raises:
        ValueError: slots that do not split over the ranks.
    """
    slots = num_experts + redundant
    if ep_size < 1 or redundant < 0 or slots % ep_size:
        raise ValueError(
            f"{num_experts} experts + {redundant} redundant must split over {ep_size} EP ranks"
        )
    load = [1.0 / (e + 1) ** zipf for e in range(num_experts)]
    replicas = [0] * num_experts
    for p in range(slots):
        replicas[p % num_experts] += 1
    per_rank = [0.0] * ep_size
    for p in range(slots):
        expert = p % num_experts
        per_rank[p // (slots // ep_size)] += load[expert] / replicas[expert]
    return sum(per_rank) / len(per_rank) / max(per_rank)
