"""Load traces (step, ramp, diurnal, spike, bursty, steady with noise) as request rates over time.

A trace is written `KIND:key=value,...`, e.g. `bursty:low=1,high=24,low_s=420,high_s=180` or
`step:low=2,high=12,at=60`; `Trace.parse` reads it and `Trace.rate(t)` is the arrival rate in
requests/s at `t` seconds from the start. The same text drives the simulated-clock fleet
(`fleetserve.operator.autoscale.fleet_sim`) and the simulated engine pods on the dev cluster
(`fleetserve.operator.autoscale.sim_pod`), so both see the same load.
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType

__all__ = ["KINDS", "Trace"]

KINDS: Mapping[str, Mapping[str, float]] = MappingProxyType(
    {
        # kind → its parameters and their defaults
        "steady": MappingProxyType({"rate": 8.0, "noise": 0.0, "seed": 1.0}),
        "step": MappingProxyType({"low": 2.0, "high": 12.0, "at": 60.0, "until": math.inf}),
        "ramp": MappingProxyType({"low": 1.0, "high": 20.0, "start": 60.0, "end": 300.0}),
        "diurnal": MappingProxyType({"low": 1.0, "high": 20.0, "period": 600.0}),
        "spike": MappingProxyType({"low": 2.0, "high": 24.0, "at": 120.0, "width": 30.0}),
        "bursty": MappingProxyType({"low": 1.0, "high": 24.0, "low_s": 420.0, "high_s": 180.0}),
    }
)


@dataclass(frozen=True, slots=True)
class Trace:
    kind: str
    params: Mapping[str, float]

    @classmethod
    def parse(cls, text: str) -> Trace:
        """`KIND:key=value,...` (unnamed parameters keep their defaults).

        Raises:
            ValueError: an unknown kind or parameter, or a value that is not a number.
        """
        kind, _, rest = text.partition(":")
        if kind not in KINDS:
            raise ValueError(f"trace kind must be one of {sorted(KINDS)}, got {kind!r}")
        params = dict(KINDS[kind])
        for item in filter(None, rest.split(",")):
            key, _, value = item.partition("=")
            if key not in params:
                raise ValueError(
                    f"trace {kind}: parameter must be one of {sorted(params)}, got {key!r}"
                )
            try:
                params[key] = float(value)
            except ValueError:
                raise ValueError(f"trace {kind}: {key} must be a number, got {value!r}") from None
        if any(v < 0 for k, v in params.items() if k != "seed"):
            raise ValueError(f"trace {kind}: parameters must be >= 0, got {params}")
        return cls(kind, MappingProxyType(params))

    def __str__(self) -> str:
        return f"{self.kind}:" + ",".join(f"{k}={v:g}" for k, v in self.params.items())

    def rate(self, t: float) -> float:
        """Requests per second at `t` seconds from the start."""
        p = self.params
        if self.kind == "steady":
            if not p["noise"]:
                return p["rate"]
            # Noise that is a function of the second (the same for every reader of the trace).
            jitter = random.Random(int(t) * 7919 + int(p["seed"])).uniform(-1, 1)
            return max(0.0, p["rate"] * (1 + p["noise"] * jitter))
        if self.kind == "step":
            return p["high"] if p["at"] <= t < p["until"] else p["low"]
        if self.kind == "ramp":
            if t <= p["start"]:
                return p["low"]
            if t >= p["end"]:
                return p["high"]
            return p["low"] + (p["high"] - p["low"]) * (t - p["start"]) / (p["end"] - p["start"])
        if self.kind == "diurnal":
            phase = (1 - math.cos(2 * math.pi * t / p["period"])) / 2
            return p["low"] + (p["high"] - p["low"]) * phase
        if self.kind == "spike":
            return p["high"] if p["at"] <= t < p["at"] + p["width"] else p["low"]
        period = p["low_s"] + p["high_s"]
        return p["high"] if (t % period) >= p["low_s"] else p["low"]
