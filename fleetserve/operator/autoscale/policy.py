"""The autoscaling policy: a pure function from what the engines report to replicas per role.

Per tick, for each autoscaled role:
  1. needed replicas from the load (fractional):
     - prefill, from the input side: prompt tokens arriving (finished + backlog growth) ÷ the
       measured prefill throughput V (tokens/s per replica) at a utilisation the TTFT budget
       allows, plus the backlog (engines' queued prompt tokens, and the router's queued requests
       × the mean prompt) drained within the budget B = targetTTFT − (uncached prompt ÷ V),
       less what the running replicas' spare capacity drains within B anyway;
       V starts at `tokensPerSecond` and follows what busy engines (a backlog of more than an
       interval's work) actually finish;
     - decode: the largest of Σ KV usage ÷ maxKVUsage, ready × (mean ITL ÷ targetITL), and
       ready × (running + waiting) ÷ running when requests wait;
  2. a recommendation: the current size when needed ÷ current is within 1 ± tolerance (so a
     noisy steady load never moves it), else ceil(needed), within min..max;
  3. stabilisation over the recommendation history (HPA-style): scale up to the lowest
     recommendation of the scale-up window, down to the highest of the scale-down window, and
     down only once the history spans that whole window;
  4. the P:D ratio band, by raising the role that lags (within its max), else lowering the one
     that leads.
"Current" is the desired size so far, starting groups included, so capacity that is still
starting counts and is never ordered twice; a sustained lower recommendation removes it like any
other group (the reconcile deletes the highest-indexed, i.e. newest, groups first). Decisions
never wait for pending groups.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from fleetserve.api.models import Autoscaling, DecodeScaling, PrefillScaling
from fleetserve.operator.autoscale.load import EngineLoad

__all__ = [
    "HISTORY_LIMIT",
    "Decision",
    "PolicyState",
    "RoleDecision",
    "RoleObservation",
    "decide",
]

HISTORY_LIMIT = 7202
"""Recommendations kept per role: the longest window (3600 s) at the shortest interval
(0.5 s), and two more; older ones fall off (they are outside every window anyway)."""

_THROUGHPUT_WEIGHT = 0.3
"""Weight of a new throughput sample in V's moving average (smooths lumpy completions)."""

_ARRIVAL_WEIGHT = 0.3
"""Weight of this tick's arrival rate in its moving average (about 3 ticks of memory)."""

_MIN_BUDGET_FRACTION = 0.25
"""The backlog is drained within at least this share of targetTTFT, even when the uncached
prompt alone takes longer (a floor, so that the backlog term stays finite)."""

_UTILISATION_BOUNDS = (0.5, 0.9)

_BUSY_INTERVALS = 1.5
"""A throughput sample needs a backlog of this many intervals' work (at the current estimate)
at the interval's start: then the engine cannot have run dry, even if it is a bit faster."""


@dataclass(frozen=True, slots=True)
class RoleObservation:
    """One role as the policy sees it this tick."""

    current: int
    """Groups desired so far (the last decision, or the spec), starting ones included."""
    loads: Mapping[str, EngineLoad]
    """Per live, ready group leader: its load (already joined with the pods alive)."""


@dataclass(frozen=True, slots=True)
class RoleDecision:
    current: int
    ready: int
    needed: float
    recommended: int
    desired: int
    reason: str


@dataclass(frozen=True, slots=True)
class Decision:
    roles: dict[str, RoleDecision]
    inputs: dict[str, float]
    reason: str

    @property
    def changed(self) -> bool:
        return any(r.desired != r.current for r in self.roles.values())


@dataclass
class PolicyState:
    """What the policy remembers between ticks of one deployment (the caller keeps it)."""

    history: dict[str, deque[tuple[float, int]]] = field(default_factory=dict)
    """Per role, (time, recommendation), oldest first, at most HISTORY_LIMIT."""
    prefill_tokens_per_s: float | None = None
    """Measured prefill throughput per replica (None: not measured yet, use the prior)."""
    prefill_arriving_per_s: float | None = None
    """Moving average of the prompt tokens arriving per second (None: no tick yet)."""

    def record(self, role: str, now: float, recommendation: int, keep_s: float) -> None:
        entries = self.history.setdefault(role, deque(maxlen=HISTORY_LIMIT))
        entries.append((now, recommendation))
        while len(entries) > 1 and entries[1][0] <= now - keep_s:
            entries.popleft()


def _prefill_need(
    scaling: PrefillScaling,
    obs: RoleObservation,
    router_queue: float,
    state: PolicyState,
    inputs: dict[str, float],
) -> tuple[float, str]:
    loads = list(obs.loads.values())
    v = state.prefill_tokens_per_s or scaling.tokens_per_second
    # NOTE: only an engine that had more queued than it can finish in the interval was busy
    # all along, so only there is its finished-token rate its throughput (at low load a
    # backlog at both ends says little: it may have idled in between).
    samples = [
        ld.prompt_tokens_per_s
        for ld in loads
        if ld.interval_s > 0
        and ld.prompt_tokens_waiting_before >= _BUSY_INTERVALS * v * ld.interval_s
        and ld.prompt_tokens_waiting > 0
    ]
    if samples:
        measured = sum(samples) / len(samples)
        prior = state.prefill_tokens_per_s or measured
        state.prefill_tokens_per_s = (
            1 - _THROUGHPUT_WEIGHT
        ) * prior + _THROUGHPUT_WEIGHT * measured
    v = state.prefill_tokens_per_s or scaling.tokens_per_second
    # NOTE: the arrival rate is averaged (Poisson arrivals and whole-prompt completions make
    # one interval's rate noisy, and the scale-down window keeps the highest recommendation);
    # a step up still acts at once through the backlog term, which is not averaged.
    sampled = sum(ld.prompt_tokens_arriving_per_s for ld in loads)
    before = state.prefill_arriving_per_s
    arriving = (
        sampled if before is None else (1 - _ARRIVAL_WEIGHT) * before + _ARRIVAL_WEIGHT * sampled
    )
    state.prefill_arriving_per_s = arriving
    prompts = [ld.mean_uncached_prompt_tokens for ld in loads if ld.mean_uncached_prompt_tokens]
    prompt = sum(prompts) / len(prompts) if prompts else 0.0
    backlog = sum(ld.prompt_tokens_waiting for ld in loads) + router_queue * prompt
    service_s = prompt / v
    budget = max(
        scaling.target_ttft_seconds - service_s, _MIN_BUDGET_FRACTION * scaling.target_ttft_seconds
    )
    # NOTE: M/D/1's mean wait ρ·s / (2(1−ρ)) stays within the budget B for ρ <= 2B / (s + 2B).
    lo, hi = _UTILISATION_BOUNDS
    utilisation = min(hi, max(lo, 2 * budget / (service_s + 2 * budget)))
    # NOTE: the replicas already serving drain part of the queue within the budget with their
    # spare capacity; only the rest needs new replicas. So the queue an M/D/1-like pool always
    # holds at moderate load does not add replicas (it made a noisy steady load flap), while a
    # step, with no spare capacity, counts all of its backlog.
    spare = max(0.0, len(loads) * v - arriving)
    excess = max(0.0, backlog - spare * budget)
    need = arriving / (v * utilisation) + excess / (v * budget)
    if not loads and router_queue > 0:
        need = max(need, 1.0)
    inputs.update(
        {
            "prefill_tokens_arriving_per_s": arriving,
            "prefill_backlog_tokens": backlog,
            "prefill_excess_backlog_tokens": excess,
            "prefill_tokens_per_s_per_replica": v,
            "prefill_mean_uncached_prompt_tokens": prompt,
            "prefill_budget_s": budget,
            "router_queue": router_queue,
        }
    )
    reason = (
        f"arriving {arriving:.0f} tok/s and backlog {backlog:.0f} tok at {v:.0f} tok/s per"
        f" replica, {budget:.2f}s budget"
    )
    return need, reason


def _decode_need(
    scaling: DecodeScaling, obs: RoleObservation, inputs: dict[str, float]
) -> tuple[float, str]:
    loads = list(obs.loads.values())
    ready = len(loads)
    kv = sum(ld.kv_usage for ld in loads)
    running = sum(ld.requests_running for ld in loads)
    waiting = sum(ld.requests_waiting for ld in loads)
    itls = [ld.mean_itl_s for ld in loads if ld.mean_itl_s is not None]
    itl = sum(itls) / len(itls) if itls else 0.0
    by_kv = kv / scaling.max_kv_usage
    by_itl = ready * itl / scaling.target_itl_seconds
    by_waiting = ready * (running + waiting) / running if running and waiting else 0.0
    if not ready and waiting:
        by_waiting = 1.0
    inputs.update(
        {
            "decode_kv_usage_sum": kv,
            "decode_running": running,
            "decode_waiting": waiting,
            "decode_mean_itl_s": itl,
        }
    )
    need, what = max(
        (by_kv, "KV usage"), (by_itl, "inter-token latency"), (by_waiting, "waiting requests")
    )
    reason = f"{what}: KV {kv:.2f}, ITL {itl * 1000:.0f} ms, {running:.0f} running, {waiting:.0f} waiting"
    return need, reason


def _recommend(need: float, current: int, lo: int, hi: int, tolerance: float) -> int:
    if current > 0 and abs(need / current - 1.0) <= tolerance:
        rec = current
    else:
        rec = math.ceil(need - 1e-9)
    return min(hi, max(lo, rec))


def _stabilise(
    entries: deque[tuple[float, int]], now: float, current: int, up_s: float, down_s: float
) -> tuple[int, str]:
    up = min(r for t, r in entries if t >= now - up_s)
    down = max(r for t, r in entries if t >= now - down_s)
    latest = entries[-1][1]
    if up > current:
        return up, f"up: every recommendation of the last {up_s:g}s >= {up}"
    if down < current and entries[0][0] <= now - down_s:
        return down, f"down: every recommendation of the last {down_s:g}s <= {down}"
    if latest < current:
        return current, f"holding: a scale-down needs {down_s:g}s of lower recommendations"
    if latest > current:
        return current, f"holding: a scale-up needs {up_s:g}s of higher recommendations"
    return current, "steady"


def _apply_ratio(
    autoscaling: Autoscaling, desired: dict[str, int], reasons: dict[str, str]
) -> None:
    band = autoscaling.ratio
    p, d = desired.get("prefill"), desired.get("decode")
    if band is None or p is None or d is None or d == 0:
        return
    bounds = {
        name: (s.min, s.max) if s is not None else (desired[name], desired[name])
        for name, s in (("prefill", autoscaling.prefill), ("decode", autoscaling.decode))
    }
    if p / d < band.min:
        raised = min(bounds["prefill"][1], math.ceil(band.min * d - 1e-9))
        if raised > p:
            desired["prefill"], reasons["prefill"] = raised, f"raised to keep P:D >= {band.min:g}"
        if desired["prefill"] / d < band.min:
            lowered = max(bounds["decode"][0], math.floor(desired["prefill"] / band.min + 1e-9))
            desired["decode"], reasons["decode"] = lowered, f"lowered to keep P:D >= {band.min:g}"
    elif p / d > band.max:
        raised = min(bounds["decode"][1], math.ceil(p / band.max - 1e-9))
        if raised > d:
            desired["decode"], reasons["decode"] = raised, f"raised to keep P:D <= {band.max:g}"
        if p / desired["decode"] > band.max:
            lowered = max(bounds["prefill"][0], math.floor(band.max * desired["decode"] + 1e-9))
            desired["prefill"], reasons["prefill"] = lowered, f"lowered to keep P:D <= {band.max:g}"


def decide(
    autoscaling: Autoscaling,
    observations: Mapping[str, RoleObservation],
    *,
    router_queue: float,
    state: PolicyState,
    now: float,
) -> Decision:
    """Desired groups per role in `observations`, with the reasons (updates `state`).

    Roles without an autoscaling block (and the unified role) keep their current size.
    """
    inputs: dict[str, float] = {}
    needs: dict[str, tuple[float, str]] = {}
    if autoscaling.prefill is not None and "prefill" in observations:
        needs["prefill"] = _prefill_need(
            autoscaling.prefill, observations["prefill"], router_queue, state, inputs
        )
    if autoscaling.decode is not None and "decode" in observations:
        needs["decode"] = _decode_need(autoscaling.decode, observations["decode"], inputs)
    keep_s = autoscaling.scale_down_stabilization_seconds
    desired: dict[str, int] = {}
    recommended: dict[str, int] = {}
    reasons: dict[str, str] = {}
    for name, obs in observations.items():
        scaling = {"prefill": autoscaling.prefill, "decode": autoscaling.decode}.get(name)
        if scaling is None or name not in needs:
            desired[name] = recommended[name] = obs.current
            reasons[name] = "not autoscaled"
            continue
        need, why = needs[name]
        if not obs.loads and need == 0 and obs.current > 0:
            # NOTE: no ready engine reports yet (all starting, or all gone): no evidence to act on.
            desired[name] = recommended[name] = min(scaling.max, max(scaling.min, obs.current))
            reasons[name] = "holding: no ready engine reports metrics"
            continue
        rec = _recommend(need, obs.current, scaling.min, scaling.max, autoscaling.tolerance)
        state.record(name, now, rec, keep_s)
        recommended[name] = rec
        target, how = _stabilise(
            state.history[name],
            now,
            obs.current,
            autoscaling.scale_up_stabilization_seconds,
            keep_s,
        )
        desired[name] = min(scaling.max, max(scaling.min, target))
        reasons[name] = f"{how} ({why})"
    _apply_ratio(autoscaling, desired, reasons)
    roles = {
        name: RoleDecision(
            current=obs.current,
            ready=len(obs.loads),
            needed=round(needs[name][0], 3) if name in needs else float(obs.current),
            recommended=recommended[name],
            desired=desired[name],
            reason=reasons[name],
        )
        for name, obs in observations.items()
    }
    moves = [f"{n} {r.current}→{r.desired}" for n, r in roles.items() if r.desired != r.current]
    return Decision(
        roles=roles,
        inputs={k: round(v, 4) for k, v in inputs.items()},
        reason="scale " + ", ".join(moves) if moves else "no change",
    )
