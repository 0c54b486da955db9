"""The pure autoscaling policy (fleetserve.operator.autoscale.policy), without a cluster."""

from __future__ import annotations

import random

import pytest

from fleetserve.api.models import Autoscaling, InferenceDeploymentSpec
from fleetserve.operator.autoscale.load import EngineLoad
from fleetserve.operator.autoscale.policy import (
    Decision,
    PolicyState,
    RoleObservation,
    decide,
)
from fleetserve.operator.autoscale.replicas import effective_replicas, with_effective_replicas

V = 4000.0  # prefill tokens/s per replica (the prior)


def _autoscaling(**over: object) -> Autoscaling:
    doc: dict[str, object] = {
        "enabled": True,
        "prefill": {"min": 1, "max": 8, "targetTTFTSeconds": 3.0, "tokensPerSecond": V},
        "decode": {"min": 1, "max": 8, "targetITLSeconds": 0.05, "maxKVUsage": 0.8},
        "intervalSeconds": 2,
        "scaleUpStabilizationSeconds": 4,
        "scaleDownStabilizationSeconds": 30,
        "tolerance": 0.1,
    }
    doc.update(over)
    return Autoscaling.model_validate(doc)


def _prefill(n: int, arriving: float, backlog: float = 0.0, prompt: float = 2000.0) -> dict:
    return {
        f"p{i}": EngineLoad(
            prompt_tokens_per_s=min(arriving / n, V),
            prompt_tokens_arriving_per_s=arriving / n,
            prompt_tokens_waiting=backlog / n,
            mean_uncached_prompt_tokens=prompt,
        )
        for i in range(n)
    }


def _decode(n: int, kv: float = 0.3, itl: float = 0.02, running: float = 4.0) -> dict:
    return {
        f"d{i}": EngineLoad(kv_usage=kv, mean_itl_s=itl, requests_running=running) for i in range(n)
    }


def _tick(
    a: Autoscaling,
    state: PolicyState,
    now: float,
    p: tuple[int, dict],
    d: tuple[int, dict],
    router_queue: float = 0.0,
) -> Decision:
    obs = {
        "prefill": RoleObservation(current=p[0], loads=p[1]),
        "decode": RoleObservation(current=d[0], loads=d[1]),
    }
    return decide(a, obs, router_queue=router_queue, state=state, now=now)


def test_a_backlog_step_scales_prefill_up_after_the_scale_up_window_only() -> None:
    a, state = _autoscaling(), PolicyState()
    for t in (0, 2, 4, 6):
        dec = _tick(a, state, t, (2, _prefill(2, 4000)), (2, _decode(2)))
        assert dec.roles["prefill"].desired == 2, dec
    # The step: 30k prompt tokens queued and 12k tok/s arriving.
    desired = []
    for t in (8, 10, 12, 14):
        dec = _tick(a, state, t, (2, _prefill(2, 12000, backlog=30000)), (2, _decode(2)))
        desired.append(dec.roles["prefill"].desired)
    # The window (4 s) holds recommendations from t=8 on at t=12: up then, not before.
    assert desired[:2] == [2, 2] and desired[2] > 2, desired
    dec = _tick(a, state, 12.5, (2, _prefill(2, 12000, backlog=30000)), (2, _decode(2)))
    # arriving 12k/(V·ρ) (averaged over the last ticks) plus 30k/(V·B): far more than 2.
    assert 6 <= dec.roles["prefill"].desired <= 8
    assert dec.roles["prefill"].needed > 5.5
    assert "backlog 30000 tok" in dec.roles["prefill"].reason


def test_a_drop_scales_down_only_after_the_scale_down_window() -> None:
    a, state = _autoscaling(), PolicyState()
    t, current = 0.0, 6
    while t <= 30:  # fill the history with high recommendations
        dec = _tick(a, state, t, (current, _prefill(6, 20000, backlog=20000)), (2, _decode(2)))
        current = dec.roles["prefill"].desired
        t += 2
    assert current >= 6
    drop_at = t
    while True:
        dec = _tick(a, state, t, (current, _prefill(current, 1000)), (2, _decode(2)))
        if dec.roles["prefill"].desired < current:
            break
        assert "holding" in dec.roles["prefill"].reason or current == 1
        t += 2
    assert t - drop_at >= a.scale_down_stabilization_seconds - 2
    # The averaged arrival rate decays over a few ticks: the window's highest recommendation
    # follows it down, to one replica (1000 tok/s is one replica's work) within a window more.
    until = t + a.scale_down_stabilization_seconds
    while t <= until and current > 1:
        current = dec.roles["prefill"].desired
        dec = _tick(a, state, t, (current, _prefill(current, 1000)), (2, _decode(2)))
        t += 2
    assert dec.roles["prefill"].desired == 1


def test_no_scale_down_before_the_history_spans_the_window() -> None:
    """A restarted operator (empty history) does not shrink a role on its first ticks."""
    a, state = _autoscaling(), PolicyState()
    for t in range(0, 28, 2):
        dec = _tick(a, state, t, (5, _prefill(5, 100)), (2, _decode(2)))
        assert dec.roles["prefill"].desired == 5
    dec = _tick(a, state, 30, (5, _prefill(5, 100)), (2, _decode(2)))
    assert dec.roles["prefill"].desired == 1


def test_min_and_max_hold() -> None:
    a = _autoscaling(
        prefill={"min": 2, "max": 3, "targetTTFTSeconds": 3.0, "tokensPerSecond": V},
        scaleUpStabilizationSeconds=0,
        scaleDownStabilizationSeconds=0,
    )
    state = PolicyState()
    dec = _tick(a, state, 0, (2, _prefill(2, 10**6, backlog=10**7)), (2, _decode(2)))
    assert dec.roles["prefill"].desired == 3 and dec.roles["prefill"].needed > 100
    dec = _tick(a, PolicyState(), 2, (3, _prefill(3, 0)), (2, _decode(2)))
    assert dec.roles["prefill"].desired == 2


def test_the_ratio_band_raises_the_lagging_role() -> None:
    a = _autoscaling(
        ratio={"min": 0.5, "max": 2.0},
        scaleUpStabilizationSeconds=0,
        scaleDownStabilizationSeconds=0,
    )
    state = PolicyState()
    # Prefill needs 6+, decode only 1: decode is raised to 3 (6 / 2.0).
    dec = _tick(a, state, 0, (2, _prefill(2, 12000, backlog=30000)), (1, _decode(1, kv=0.1)))
    p, d = dec.roles["prefill"].desired, dec.roles["decode"].desired
    assert 0.5 <= p / d <= 2.0, (p, d)
    assert "P:D <= 2" in dec.roles["decode"].reason
    # Decode needs 8 (KV), prefill 1: prefill is raised to 4.
    dec = _tick(a, state, 2, (1, _prefill(1, 100)), (2, _decode(2, kv=3.2)))
    p, d = dec.roles["prefill"].desired, dec.roles["decode"].desired
    assert (p, d) == (4, 8), dec


def test_the_ratio_band_lowers_the_leader_when_the_laggard_is_at_its_max() -> None:
    a = _autoscaling(
        decode={"min": 1, "max": 2},
        ratio={"min": 0.5, "max": 2.0},
        scaleUpStabilizationSeconds=0,
        scaleDownStabilizationSeconds=0,
    )
    dec = _tick(a, PolicyState(), 0, (2, _prefill(2, 40000, backlog=10**5)), (1, _decode(1)))
    assert (dec.roles["prefill"].desired, dec.roles["decode"].desired) == (4, 2), dec


def test_decode_follows_kv_usage_itl_and_waiting_requests() -> None:
    a = _autoscaling(scaleUpStabilizationSeconds=0)
    # KV: 2 × 0.7 = 1.4 of 0.8 each → 1.75 → 2 (within tolerance of 2: stays).
    dec = _tick(a, PolicyState(), 0, (1, _prefill(1, 100)), (2, _decode(2, kv=0.7)))
    assert dec.roles["decode"].desired == 2
    # KV 0.95 each: 2.375 → 3.
    dec = _tick(a, PolicyState(), 0, (1, _prefill(1, 100)), (2, _decode(2, kv=0.95)))
    assert dec.roles["decode"].desired == 3 and "KV usage" in dec.roles["decode"].reason
    # ITL 100 ms against 50: twice the replicas.
    dec = _tick(a, PolicyState(), 0, (1, _prefill(1, 100)), (2, _decode(2, itl=0.1)))
    assert dec.roles["decode"].desired == 4 and "inter-token" in dec.roles["decode"].reason
    # 8 running, 8 waiting on each: twice the replicas.
    loads = {f"d{i}": EngineLoad(requests_running=8, requests_waiting=8) for i in range(2)}
    dec = _tick(a, PolicyState(), 0, (1, _prefill(1, 100)), (2, loads))
    assert dec.roles["decode"].desired == 4 and "waiting" in dec.roles["decode"].reason


def test_starting_groups_count_as_capacity() -> None:
    """Two of four groups still start (no metrics): the need of four is already met."""
    a = _autoscaling(scaleUpStabilizationSeconds=0)
    loads = _prefill(2, 8000, backlog=8000)  # needs ≈ 4 (computed for 2 reporting pods)
    dec = _tick(a, PolicyState(), 0, (4, loads), (1, _decode(1)))
    assert dec.roles["prefill"].needed <= 4.4
    assert dec.roles["prefill"].desired == 4 and dec.roles["prefill"].ready == 2


def test_a_sustained_lower_recommendation_cancels_pending_groups() -> None:
    """Pending groups never block a decision: after the window they are removed."""
    a, state = _autoscaling(), PolicyState()
    t, out = 0.0, []
    while t <= 40:
        # 6 desired, only 2 ever become ready; the load needs 1.
        dec = _tick(a, state, t, (6, _prefill(2, 500)), (1, _decode(1)))
        out.append(dec.roles["prefill"].desired)
        t += 2
    assert out[0] == 6 and out[-1] == 1


def test_no_ready_engine_means_no_evidence() -> None:
    a = _autoscaling(scaleUpStabilizationSeconds=0, scaleDownStabilizationSeconds=0)
    dec = _tick(a, PolicyState(), 0, (3, {}), (2, {}))
    assert dec.roles["prefill"].desired == 3 and "no ready engine" in dec.roles["prefill"].reason
    assert not dec.changed


def test_the_router_queue_counts_as_prefill_backlog() -> None:
    a = _autoscaling(scaleUpStabilizationSeconds=0)
    alone = _tick(a, PolicyState(), 0, (1, _prefill(1, 1000)), (1, _decode(1)))
    queued = _tick(a, PolicyState(), 0, (1, _prefill(1, 1000)), (1, _decode(1)), router_queue=20)
    assert alone.roles["prefill"].desired == 1
    # 20 requests × 2000 tokens = 40k tokens, less the 7.5k the one replica's spare 3000 tok/s
    # drains within the ≈ 2.5 s budget: 3+ more replicas.
    assert queued.roles["prefill"].desired >= 4
    assert queued.inputs["prefill_backlog_tokens"] == 40000


def test_the_queue_running_replicas_drain_in_time_adds_none() -> None:
    """At half load, a request or two queued per engine is normal queueing, not demand."""
    a = _autoscaling(scaleUpStabilizationSeconds=0)
    dec = _tick(a, PolicyState(), 0, (2, _prefill(2, 4000, backlog=8000)), (1, _decode(1)))
    assert dec.roles["prefill"].desired == 2
    assert dec.inputs["prefill_excess_backlog_tokens"] == 0


def test_measured_throughput_replaces_the_prior() -> None:
    a = _autoscaling()
    state = PolicyState()
    slow = {
        "p0": EngineLoad(
            prompt_tokens_per_s=1000,
            prompt_tokens_arriving_per_s=1000,
            prompt_tokens_waiting=500,
            prompt_tokens_waiting_before=20000,
            interval_s=2.0,
            mean_uncached_prompt_tokens=500,
        )
    }
    for t in range(0, 40, 2):
        _tick(a, state, t, (1, slow), (1, _decode(1)))
    assert state.prefill_tokens_per_s == pytest.approx(1000, rel=0.01)
    # An engine with less queued than an interval's work may have idled: no sample.
    idle = {"p0": EngineLoad(prompt_tokens_per_s=300, prompt_tokens_waiting=100,
                             prompt_tokens_waiting_before=1000, interval_s=2.0)}  # fmt: skip
    _tick(a, state, 50, (1, idle), (1, _decode(1)))
    assert state.prefill_tokens_per_s == pytest.approx(1000, rel=0.01)


def test_noisy_steady_load_never_flaps() -> None:
    """Simulated time: 10 minutes of ±15% noise around a steady load, a tick every 2 s."""
    a = _autoscaling(scaleDownStabilizationSeconds=60)
    state, rng = PolicyState(), random.Random(7)
    p, d, changes = 3, 2, []
    for step in range(300):
        noise = 1 + rng.uniform(-0.15, 0.15)
        dec = _tick(
            a,
            state,
            step * 2.0,
            (p, _prefill(p, 6000 * noise, backlog=1500 * noise)),
            (d, _decode(d, kv=0.55 * noise)),
        )
        if dec.changed:
            changes.append((step, dec.reason))
        p, d = dec.roles["prefill"].desired, dec.roles["decode"].desired
    # At most one move per role towards the noise's top, and never back down.
    assert len(changes) <= 2, changes


def test_effective_replicas_follow_the_autoscaler_only_when_enabled() -> None:
    doc = {
        "model": {"name": "m", "source": {"uri": "/m"}},
        "roles": {"prefill": {"replicas": 1}, "decode": {"replicas": 2}},
        "autoscaling": {"enabled": True, "prefill": {"min": 1, "max": 4}},
    }
    spec = InferenceDeploymentSpec.model_validate(doc)
    status = {"roles": {"prefill": {"desiredReplicas": 9}, "decode": {"desiredReplicas": 5}}}
    # prefill: the decision within max; decode has no block: the spec's.
    assert effective_replicas(spec, status) == {"prefill": 4, "decode": 2}
    assert effective_replicas(spec, {}) == {"prefill": 1, "decode": 2}
    assert with_effective_replicas(spec, status).roles.prefill.replicas == 4  # type: ignore[union-attr]
    off = InferenceDeploymentSpec.model_validate(
        {**doc, "autoscaling": {**doc["autoscaling"], "enabled": False}}  # type: ignore[dict-item]
    )
    assert effective_replicas(off, status) == {"prefill": 1, "decode": 2}


@pytest.mark.parametrize(
    ("block", "message"),
    [
        ({"prefill": {"min": 3, "max": 1}}, "autoscaling.prefill: min must be <= max"),
        ({"ratio": {"min": 2, "max": 1}}, "autoscaling.ratio: min must be <= max"),
        (
            {"scaleUpStabilizationSeconds": 60, "scaleDownStabilizationSeconds": 10},
            "scaleUpStabilizationSeconds must be <= scaleDownStabilizationSeconds",
        ),
        ({"decode": {"maxKVUsage": 1.5}}, "maxKVUsage"),
        ({"prefill": {"targetTTFTSeconds": 0}}, "targetTTFTSeconds"),
        ({"tolerance": 0.95}, "tolerance"),
    ],
)
def test_bad_autoscaling_blocks_are_rejected_naming_the_field(
    block: dict[str, object], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        Autoscaling.model_validate({"enabled": True, **block})
