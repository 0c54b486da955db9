"""Whether a desired object already holds on a live one (the reconcile writes only when not)."""

from __future__ import annotations

from typing import Any

__all__ = ["is_subset"]


def is_subset(desired: Any, live: Any) -> bool:
    """True when every field of `desired` holds in `live` (server defaults may add more)."""
    if isinstance(desired, dict):
        return isinstance(live, dict) and all(
            k in live and is_subset(v, live[k]) for k, v in desired.items()
        )
    if isinstance(desired, list):
        return (
            isinstance(live, list)
            and len(desired) == len(live)
            and all(is_subset(d, v) for d, v in zip(desired, live, strict=True))
        )
    return bool(desired == live)
