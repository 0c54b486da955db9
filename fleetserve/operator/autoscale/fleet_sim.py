"""A whole P/D fleet of simulated engines on a simulated clock, scaled by the real policy.

Requests arrive as a Poisson process at the trace's rate, each with `prompt_tokens` and
`output_tokens`. The router sends a request to the ready prefill engine with the least backlog,
then to the decode engine with the fewest requests; with none ready it queues them (counted in
the router queue the policy reads). Every `autoscaling.intervalSeconds` the policy sees each ready
group's `EngineLoad` (rates between its last two scrapes, exactly as the operator's loop
computes them) and its decision is applied: new groups become ready after `cold_start_s`;
removed groups (the newest first) take no new requests and go once empty, as a KV-safe drain
would. With `static` set, the fleet keeps that many groups per role and no policy runs (the
peak-sized pool to compare with).

The result: per-request TTFT and mean ITL, SLO attainment, and the replica-seconds each role
used (starting and draining groups included: they hold their hardware).
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

from fleetserve.api.models import Autoscaling
from fleetserve.operator.autoscale.load import EngineCounters, EngineLoad, engine_load
from fleetserve.operator.autoscale.policy import PolicyState, RoleObservation, decide
from fleetserve.operator.autoscale.sim_engine import EngineModel, SimEngine, SimRequest
from fleetserve.operator.autoscale.trace import Trace

__all__ = ["FleetResult", "FleetSim", "Sample"]

ROLES = ("prefill", "decode")


@dataclass
class _Group:
    engine: SimEngine
    ready_at: float
    draining: bool = False
    last: EngineCounters | None = None


@dataclass(frozen=True, slots=True)
class Sample:
    """The fleet at one policy tick (one row of the plots)."""

    t: float
    rate: float
    desired: dict[str, int]
    ready: dict[str, int]
    alive: dict[str, int]
    reason: str


@dataclass
class FleetResult:
    requests: list[SimRequest]
    timeline: list[Sample]
    replica_seconds: dict[str, float]
    target_ttft_s: float
    target_itl_s: float
    decisions: int = 0

    def attained(self, r: SimRequest) -> bool:
        """Within both targets (a request that never finished is a miss)."""
        itl = r.mean_itl_s
        ttft = r.ttft_s
        return (
            r.done_s is not None
            and ttft is not None
            and ttft <= self.target_ttft_s
            and itl is not None
            and itl <= self.target_itl_s
        )

    @property
    def attainment(self) -> float:
        return sum(map(self.attained, self.requests)) / max(1, len(self.requests))

    def share_within(self, what: str) -> float:
        """Share of requests within the TTFT target (`what="ttft"`) or the ITL target."""
        if what == "ttft":
            ok = [r.ttft_s is not None and r.ttft_s <= self.target_ttft_s for r in self.requests]
        else:
            ok = [
                r.mean_itl_s is not None and r.mean_itl_s <= self.target_itl_s
                for r in self.requests
            ]
        return sum(ok) / max(1, len(ok))


@dataclass
class FleetSim:
    autoscaling: Autoscaling
    model: EngineModel = field(default_factory=EngineModel)
    prompt_tokens: int = 8192
    output_tokens: int = 256
    cold_start_s: float = 15.0
    static: dict[str, int] | None = None
    initial: dict[str, int] = field(default_factory=lambda: {"prefill": 1, "decode": 1})
    dt_s: float = 0.1
    seed: int = 0

    def __post_init__(self) -> None:
        if self.autoscaling.prefill is None or self.autoscaling.decode is None:
            raise ValueError("FleetSim.autoscaling needs both a prefill and a decode block")
        if self.dt_s <= 0 or self.cold_start_s < 0:
            raise ValueError("FleetSim.dt_s must be > 0 and cold_start_s >= 0")

    def run(self, trace: Trace, duration_s: float) -> FleetResult:
        a = self.autoscaling
        assert a.prefill is not None and a.decode is not None
        rng = random.Random(self.seed)
        start = self.static or self.initial
        groups = {role: [self._group(role, 0.0) for _ in range(start[role])] for role in ROLES}
        desired = dict(start)
        state = PolicyState()
        router_prefill: deque[SimRequest] = deque()
        router_decode: deque[SimRequest] = deque()
        requests: list[SimRequest] = []
        timeline: list[Sample] = []
        used = dict.fromkeys(ROLES, 0.0)
        next_arrival = rng.expovariate(max(trace.rate(0.0), 1e-9))
        next_tick, decisions, now = 0.0, 0, 0.0
        while now < duration_s:
            while next_arrival < now + self.dt_s:
                r = SimRequest(next_arrival, self.prompt_tokens, self.output_tokens)
                requests.append(r)
                router_prefill.append(r)
                rate = max(trace.rate(next_arrival), 1e-9)
                next_arrival += rng.expovariate(rate)
            ready = {
                role: [g for g in groups[role] if g.ready_at <= now and not g.draining]
                for role in ROLES
            }
            self._route(router_prefill, ready["prefill"], by_backlog=True)
            self._route(router_decode, ready["decode"], by_backlog=False)
            for g in groups["prefill"]:
                if g.ready_at <= now:
                    router_decode.extend(g.engine.advance(now, self.dt_s))
            for g in groups["decode"]:
                if g.ready_at <= now:
                    g.engine.advance(now, self.dt_s)
            for role in ROLES:
                used[role] += len(groups[role]) * self.dt_s
                groups[role] = [g for g in groups[role] if not (g.draining and _empty(g.engine))]
            now += self.dt_s
            if now >= next_tick:
                next_tick += a.interval_seconds
                reason = "static"
                if self.static is None:
                    obs = {
                        role: RoleObservation(
                            current=desired[role], loads=self._loads(ready[role], now)
                        )
                        for role in ROLES
                    }
                    decision = decide(
                        a, obs, router_queue=len(router_prefill), state=state, now=now
                    )
                    reason = decision.reason
                    decisions += decision.changed
                    for role in ROLES:
                        desired[role] = decision.roles[role].desired
                        self._resize(groups, role, desired[role], now)
                timeline.append(
                    Sample(
                        t=now,
                        rate=trace.rate(now),
                        desired=dict(desired),
                        ready={role: len(ready[role]) for role in ROLES},
                        alive={role: len(groups[role]) for role in ROLES},
                        reason=reason,
                    )
                )
        return FleetResult(
            requests=requests,
            timeline=timeline,
            replica_seconds=used,
            target_ttft_s=a.prefill.target_ttft_seconds,
            target_itl_s=a.decode.target_itl_seconds,
            decisions=decisions,
        )

    def _group(self, role: str, ready_at: float) -> _Group:
        return _Group(SimEngine(role, self.model), ready_at)

    @staticmethod
    def _route(queue: deque[SimRequest], ready: list[_Group], *, by_backlog: bool) -> None:
        while queue and ready:

            def load(g: _Group) -> float:
                e = g.engine
                return e.backlog_tokens if by_backlog else len(e.queue) + len(e.running)

            target = min(ready, key=load)
            if not target.engine.submit(queue[0]):
                return
            queue.popleft()

    @staticmethod
    def _loads(ready: list[_Group], now: float) -> dict[str, EngineLoad]:
        out = {}
        for i, g in enumerate(ready):
            current = g.engine.counters(now)
            out[str(i)] = engine_load(g.last, current)
            g.last = current
        return out

    def _resize(self, groups: dict[str, list[_Group]], role: str, want: int, now: float) -> None:
        live = [g for g in groups[role] if not g.draining]
        if want > len(live):
            # NOTE: a drain cancelled by a scale-up takes the draining group back first.
            for g in [g for g in groups[role] if g.draining][: want - len(live)]:
                g.draining = False
            live = [g for g in groups[role] if not g.draining]
            groups[role] += [
                self._group(role, now + self.cold_start_s) for _ in range(want - len(live))
            ]
        for g in live[want:]:
            g.draining = True


def _empty(e: SimEngine) -> bool:
    return not e.queue and not e.running
