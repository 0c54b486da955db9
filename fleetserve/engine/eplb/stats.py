"""What EPLB reports to the engine's metrics (torch-free: it travels in `SchedulerStats`)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EplbStats"]


@dataclass
class EplbStats:
    """Cumulative counts and the latest window's figures of one engine's EPLB."""

    balancedness: float | None = None
    """Mean ÷ max per-rank load over the last window (mean over MoE layers; None: no window
    with tokens yet)."""
    planned_balancedness: float | None = None
    """What the placement in use predicts for that window's load (round-robin replicas)."""
    rebalances: int = 0
    """New placements committed."""
    skipped: int = 0
    """Rebalances skipped: the gain was under the threshold (or the window had no tokens)."""
    last_rearrange_s: float = 0.0
    """Seconds the step loop was blocked by the last rearrangement (async: the commit only)."""
    steps: int = 0
    """Steps counted since the engine started."""
