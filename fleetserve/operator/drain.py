"""KV-safe drain of a replica group: mark it, wait until nothing is in flight there, then let go.

A group is drained before it is deleted, for a scale-down or because a roll replaced it
(`fleetserve.operator.roll`). Its StatefulSet carries `ANNOTATION_DRAINING_SINCE` and
`ANNOTATION_DRAIN_REASON` and each of its pods `LABEL_DRAINING` (`fleetserve.api.labels`): the
router's discovery drops labelled pods at once, so they get no new request, and the state lives
in the cluster, so an operator that restarts resumes the drain where it was.

The group is done when its leader pod (the one that serves HTTP) reports, on its `/metrics`,
no running or waiting request and no producer KV lease (a prompt whose KV a decode engine has
yet to pull), once the drain is at least `DRAIN_SETTLE_S` old (requests the router chose just
before it saw the label must have reached the engine), or when the role's drain timeout has
passed (the deletion then may cut what is still in flight; an event says how much). A leader
that is not running, or refuses the connection, serves nothing; one whose `/metrics` cannot be
read otherwise is waited for, up to the timeout.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal

from prometheus_client.parser import text_string_to_metric_families

from fleetserve.api.labels import (
    ANNOTATION_DRAIN_REASON,
    ANNOTATION_DRAINING_SINCE,
    LABEL_DRAINING,
    LABEL_POD_INDEX,
)
from fleetserve.api.models import Condition
from fleetserve.common.metric_names import (
    KV_ACTIVE_LEASES,
    NUM_REQUESTS_RUNNING,
    NUM_REQUESTS_WAITING,
)

__all__ = [
    "DRAIN_POLL_S",
    "DRAIN_SETTLE_S",
    "DrainState",
    "DrainingGroup",
    "drain_annotations",
    "drain_progress",
    "draining_condition",
    "draining_label",
    "draining_since",
    "in_flight_from_metrics",
    "probe_leader",
]

DRAIN_SETTLE_S = 5.0
"""A drain is never done sooner: the router sees the label within a watch event, and a request
it picked just before must reach the engine's queue to be counted."""
DRAIN_POLL_S = 2.0
"""How often a deployment with a draining group is reconciled again (its engines' counts are no
Kubernetes events)."""
PROBE_TIMEOUT_S = 3.0

_IN_FLIGHT_SAMPLES = frozenset(
    {
        NUM_REQUESTS_RUNNING.sample_name,
        NUM_REQUESTS_WAITING.sample_name,
        KV_ACTIVE_LEASES.sample_name,
    }
)

DrainState = Literal["draining", "drained", "timed-out"]


@dataclass(frozen=True, slots=True)
class DrainingGroup:
    """A group being drained, as read from its StatefulSet's annotations."""

    role: str
    index: int
    since: datetime
    reason: str
    timeout_s: float

    @property
    def deadline(self) -> datetime:
        """When the timeout ends the drain (never before the settle time)."""
        return self.since + timedelta(seconds=max(self.timeout_s, DRAIN_SETTLE_S))


def drain_annotations(since: str | None, reason: str | None) -> dict[str, str | None]:
    """The StatefulSet annotations that mark a drain (None values: the merge patch that ends it)."""
    return {ANNOTATION_DRAINING_SINCE: since, ANNOTATION_DRAIN_REASON: reason}


def draining_label(draining: bool) -> dict[str, str | None]:
    """The pod labels of a draining group (draining=False: the merge patch that ends it)."""
    return {LABEL_DRAINING: "true" if draining else None}


def draining_since(sts: dict[str, Any]) -> tuple[datetime | None, str] | None:
    """(start, reason) of the StatefulSet's drain, None when it is not draining.

    The start is None when it does not parse (a hand-edited annotation): the caller restamps it,
    so the drain restarts rather than timing out at once and cutting requests.
    """
    annotations = (sts.get("metadata") or {}).get("annotations") or {}
    stamp = annotations.get(ANNOTATION_DRAINING_SINCE)
    if not stamp:
        return None
    reason = str(annotations.get(ANNOTATION_DRAIN_REASON) or "scale-down")
    try:
        return datetime.fromisoformat(str(stamp).replace("Z", "+00:00")), reason
    except ValueError:
        return None, reason


def in_flight_from_metrics(text: str) -> int:
    """Running + waiting requests + producer leases in an engine's Prometheus text.

    Raises:
        ValueError: not Prometheus text, or none of those gauges (then it is no fleetserve
            engine, and its count is unknown).
    """
    total = 0.0
    seen = False
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _IN_FLIGHT_SAMPLES:
                total += sample.value
                seen = True
    if not seen:
        raise ValueError("the engine's /metrics has no request or lease gauges")
    return round(total)


def _leader(pods: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    for pod in pods:
        labels = (pod.get("metadata") or {}).get("labels") or {}
        if labels.get(LABEL_POD_INDEX, "0") == "0":
            return pod
    return None


def probe_leader(
    pods: Sequence[dict[str, Any]],
    port: int,
    fetch: Callable[[str], str] | None = None,
) -> int | None:
    """Requests and leases in flight on a group (its leader's `/metrics`); None: unknown.

    0 when the leader is gone, not running, has no IP or refuses connections: nothing can be in
    flight on an engine that does not listen.
    """
    leader = _leader(pods)
    status = (leader or {}).get("status") or {}
    ip = status.get("podIP")
    if leader is None or status.get("phase") != "Running" or not ip:
        return 0
    host = f"[{ip}]" if ":" in ip else ip
    url = f"http://{host}:{port}/metrics"
    try:
        return in_flight_from_metrics((fetch or _fetch)(url))
    except ConnectionRefusedError:
        return 0
    except urllib.error.URLError as exc:
        return 0 if isinstance(exc.reason, ConnectionRefusedError) else None
    except (OSError, ValueError):
        return None


def _fetch(url: str) -> str:
    with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S) as resp:
        return str(resp.read().decode())


def drain_progress(
    since: datetime, now: datetime, timeout_s: float, in_flight: Callable[[], int | None]
) -> tuple[DrainState, int | None]:
    """Where a drain stands, and the count read: `drained` once settled with nothing in flight,
    `timed-out` past the timeout with something (or an unknown count) still there, else
    `draining`. `in_flight` (a probe of the group) is not called before the drain settled."""
    age = (now - since).total_seconds()
    if age < DRAIN_SETTLE_S:
        return "draining", None
    count = in_flight()
    if count == 0:
        return "drained", 0
    return ("timed-out" if age >= timeout_s else "draining"), count


def draining_condition(draining: Sequence[DrainingGroup]) -> Condition:
    """The `Draining` condition, from the groups draining now: True naming each one, why, since
    when and the deadline its timeout sets; False when none drains. (How a drain ended is an
    event, `Drained` or the Warning `DrainTimedOut`: a condition computed from a pass that
    started from an older event body could not keep it reliably.)"""
    if not draining:
        return Condition(
            type="Draining", status="False", reason="NoDrain", message="no group drains"
        )
    parts = [
        f"{g.role} group {g.index} ({g.reason}) since {_stamp(g.since)},"
        f" deleted by {_stamp(g.deadline)} at the latest"
        for g in sorted(draining, key=lambda g: (g.role, g.index))
    ]
    return Condition(type="Draining", status="True", reason="Draining", message="; ".join(parts))


def _stamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")
