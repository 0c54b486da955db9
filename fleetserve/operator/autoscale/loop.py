"""The autoscaler in the operator: per InferenceDeployment with `autoscaling.enabled`, every
`intervalSeconds`, scrape each live group leader's and the router's `/metrics`, decide, and write
the decision to status (`roles.<role>.desiredReplicas`, which the reconcile reads through
`effective_replicas`, and `lastScaleDecision`), an event and the `fleetserve:autoscaler_*`
metrics.

One asyncio task for the whole operator (`Autoscaler.run`) rather than a kopf timer or daemon
per object: kopf puts a finalizer on every object a timer or daemon serves, and this operator
keeps deletion free of finalizers (handlers.py), so that deleting a deployment never waits for
the operator. The deployments to serve come from the event handler (`track`); each tick reads
the object afresh, so a stale event never drives a decision.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import logging
import math
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from fleetserve.api.labels import (
    LABEL_DEPLOYMENT,
    LABEL_GROUP,
    LABEL_POD_INDEX,
    LABEL_ROLE,
    ROUTER_ROLE,
)
from fleetserve.api.models import InferenceDeploymentSpec, ScaleDecision, ScaleDecisionRole
from fleetserve.operator.autoscale.load import (
    EngineCounters,
    EngineLoad,
    engine_load,
    parse_engine_metrics,
    parse_router_queue,
)
from fleetserve.operator.autoscale.metrics import AutoscalerMetrics
from fleetserve.operator.autoscale.policy import Decision, PolicyState, RoleObservation, decide
from fleetserve.operator.autoscale.replicas import autoscaled_roles, effective_replicas
from fleetserve.operator.builders import ROUTER_PORT
from fleetserve.operator.kube import Kube
from fleetserve.operator.render import ENGINE_PORT

__all__ = ["SCRAPE_TIMEOUT_S", "STATUS_REFRESH_S", "Autoscaler", "alive_leaders", "http_scrape"]

log = logging.getLogger("fleetserve.operator.autoscale")

SCRAPE_TIMEOUT_S = 1.0
"""Per `/metrics` request: a pod that does not answer in time does not count this tick."""
STATUS_REFRESH_S = 30.0
"""`lastScaleDecision` is rewritten when a role's desired size changes, else at most this often
(so its inputs stay current without a status write every tick)."""
_MAX_SCRAPES_IN_FLIGHT = 16
_MAX_TICKS_IN_FLIGHT = 4
_LOOP_GRANULARITY_S = 0.2


def http_scrape(url: str) -> str:
    """GET `url` (http://IP:PORT/path) within SCRAPE_TIMEOUT_S; the body as text.

    Raises:
        OSError, http.client.HTTPException, ValueError: no answer, or not 200.
    """
    host_port, _, path = url.removeprefix("http://").partition("/")
    host, _, port = host_port.rpartition(":")
    # NOTE: http.client, not urllib: proxy environment variables must not apply to pod IPs.
    conn = http.client.HTTPConnection(host, int(port), timeout=SCRAPE_TIMEOUT_S)
    try:
        conn.request("GET", "/" + path)
        resp = conn.getresponse()
        body = resp.read().decode()
        if resp.status != 200:
            raise ValueError(f"GET {url}: HTTP {resp.status}")
        return body
    finally:
        conn.close()


def _ready(pod: dict[str, Any]) -> bool:
    st = pod.get("status") or {}
    return (
        not pod["metadata"].get("deletionTimestamp")
        and st.get("phase") == "Running"
        and bool(st.get("podIP"))
        and any(
            c.get("type") == "Ready" and c.get("status") == "True"
            for c in st.get("conditions") or []
        )
    )


def alive_leaders(
    pods: list[dict[str, Any]], current: dict[str, int]
) -> dict[str, dict[str, dict[str, Any]]]:
    """Role → pod uid → pod, for the ready leader (pod 0) of each group the role keeps.

    Groups at or beyond `current[role]` are on their way out and do not count.
    """
    out: dict[str, dict[str, dict[str, Any]]] = {role: {} for role in current}
    for pod in pods:
        labels = pod["metadata"].get("labels") or {}
        role = labels.get(LABEL_ROLE, "")
        if role not in current or labels.get(LABEL_POD_INDEX, "0") != "0" or not _ready(pod):
            continue
        try:
            group = int(labels.get(LABEL_GROUP, ""))
        except ValueError:
            continue
        if group < current[role]:
            out[role][pod["metadata"]["uid"]] = pod
    return out


@dataclass
class _Target:
    namespace: str
    name: str
    interval_s: float
    next_due: float = 0.0
    policy: PolicyState = field(default_factory=PolicyState)
    last: dict[str, EngineCounters] = field(default_factory=dict)
    """Per pod uid, its previous scrape (pods that are gone are dropped each tick)."""
    written_at: float = -math.inf
    written: dict[str, int] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclass
class Autoscaler:
    """The operator's autoscaler: which deployments it serves, and one tick of each."""

    kube: Kube
    metrics: AutoscalerMetrics
    lock_for: Callable[[str], threading.Lock]
    post_event: Callable[[dict[str, Any], str, str, str], None]
    """(object, type, reason, message) → posted as a Kubernetes event."""
    scrape: Callable[[str], str] = http_scrape
    clock: Callable[[], float] = time.monotonic
    targets: dict[str, _Target] = field(default_factory=dict)
    _guard: threading.Lock = field(default_factory=threading.Lock)
    _pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(_MAX_SCRAPES_IN_FLIGHT, "autoscaler-scrape")
    )

    def track(self, body: dict[str, Any]) -> None:
        """Serve `body`'s deployment when its autoscaling is enabled, else stop serving it."""
        meta = body["metadata"]
        auto = (body.get("spec") or {}).get("autoscaling") or {}
        key = f"{meta['namespace']}/{meta['name']}"
        with self._guard:
            if not auto.get("enabled") or meta.get("deletionTimestamp"):
                gone = self.targets.pop(key, None)
            else:
                interval = float(auto.get("intervalSeconds", 2.0))
                target = self.targets.setdefault(
                    key, _Target(meta["namespace"], meta["name"], interval)
                )
                target.interval_s = interval
                return
        if gone is not None:
            self.metrics.forget(gone.namespace, gone.name, list(gone.written))

    def forget(self, namespace: str, name: str) -> None:
        self.track({"metadata": {"namespace": namespace, "name": name}, "spec": {}})

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def run(self, stop: asyncio.Event) -> None:
        """Tick every due deployment until `stop` is set (ticks of one deployment never overlap)."""
        # NOTE: ticks run in the loop's default executor, which kopf's sync handlers share:
        # at most _MAX_TICKS_IN_FLIGHT of its threads are the autoscaler's at any time.
        slots = asyncio.Semaphore(_MAX_TICKS_IN_FLIGHT)
        while not stop.is_set():
            now = self.clock()
            with self._guard:
                due = [t for t in self.targets.values() if t.next_due <= now]
                for t in due:
                    t.next_due = now + t.interval_s
            if due:
                results = await asyncio.gather(
                    *(self._tick_in_thread(slots, t) for t in due), return_exceptions=True
                )
                for t, result in zip(due, results, strict=True):
                    if isinstance(result, BaseException):
                        log.warning("autoscaler tick of %s failed: %r", t.key, result)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), _LOOP_GRANULARITY_S)

    async def _tick_in_thread(self, slots: asyncio.Semaphore, target: _Target) -> Decision | None:
        async with slots:
            return await asyncio.to_thread(self.tick, target)

    def tick(self, target: _Target) -> Decision | None:
        """One scrape-decide-write round for `target`; None when it is gone or not autoscaled.

        Raises:
            ApiException, urllib3 errors: API failures (the next tick tries again).
        """
        started = self.clock()
        body = self.kube.get("InferenceDeployment", target.namespace, target.name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self.forget(target.namespace, target.name)
            return None
        try:
            spec = InferenceDeploymentSpec.model_validate(body["spec"])
        except ValueError:
            return None  # the reconcile reports a spec it cannot realise
        if not autoscaled_roles(spec):
            self.forget(target.namespace, target.name)
            return None
        status = body.get("status") or {}
        current = effective_replicas(spec, status)
        pods = self.kube.list("Pod", target.namespace, f"{LABEL_DEPLOYMENT}={target.name}")
        leaders = alive_leaders(pods, current)
        loads, errors = self._scrape_engines(target, leaders)
        router_queue, router_errors = self._scrape_router(pods)
        if errors + router_errors:
            self.metrics.scrape_errors.labels(target.namespace, target.name).inc(
                errors + router_errors
            )
        observations = {
            role: RoleObservation(current=current[role], loads=loads.get(role, {}))
            for role in current
        }
        decision = decide(
            spec.autoscaling,
            observations,
            router_queue=router_queue,
            state=target.policy,
            now=self.clock(),
        )
        self._write(target, body, spec, decision)
        self.metrics.record(target.namespace, target.name, decision, self.clock() - started)
        return decision

    def _scrape_engines(
        self, target: _Target, leaders: dict[str, dict[str, dict[str, Any]]]
    ) -> tuple[dict[str, dict[str, EngineLoad]], int]:
        jobs = {
            (role, uid): self._pool.submit(
                self._scrape_counters, f"http://{pod['status']['podIP']}:{ENGINE_PORT}/metrics"
            )
            for role, pods in leaders.items()
            for uid, pod in pods.items()
        }
        loads: dict[str, dict[str, EngineLoad]] = {role: {} for role in leaders}
        seen: dict[str, EngineCounters] = {}
        errors = 0
        for (role, uid), job in jobs.items():
            try:
                counters = job.result()
            except (OSError, http.client.HTTPException, ValueError) as exc:
                log.info("scrape of %s pod %s failed: %r", target.key, uid, exc)
                errors += 1
                continue
            name = leaders[role][uid]["metadata"]["name"]
            loads[role][name] = engine_load(target.last.get(uid), counters)
            seen[uid] = counters
        # NOTE: only pods that answered now are remembered: a dead pod's counters never linger.
        target.last = seen
        return loads, errors

    def _scrape_counters(self, url: str) -> EngineCounters:
        text = self.scrape(url)
        return parse_engine_metrics(text, self.clock())

    def _scrape_router(self, pods: list[dict[str, Any]]) -> tuple[float, int]:
        routers = [
            p
            for p in pods
            if (p["metadata"].get("labels") or {}).get(LABEL_ROLE) == ROUTER_ROLE and _ready(p)
        ]
        jobs = [
            self._pool.submit(self.scrape, f"http://{p['status']['podIP']}:{ROUTER_PORT}/metrics")
            for p in routers
        ]
        depth, errors = 0.0, 0
        for job in jobs:
            try:
                depth += parse_router_queue(job.result())
            except (OSError, http.client.HTTPException, ValueError):
                errors += 1
        return depth, errors

    def _write(
        self,
        target: _Target,
        body: dict[str, Any],
        spec: InferenceDeploymentSpec,
        decision: Decision,
    ) -> None:
        scaled = autoscaled_roles(spec)
        desired = {role: decision.roles[role].desired for role in scaled}
        now = self.clock()
        changed = desired != target.written
        if not changed and now - target.written_at < STATUS_REFRESH_S:
            return
        record = ScaleDecision(
            time=datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            reason=decision.reason,
            roles={
                role: ScaleDecisionRole(
                    current=r.current,
                    ready=r.ready,
                    desired=r.desired,
                    needed=r.needed,
                    reason=r.reason,
                )
                for role, r in decision.roles.items()
            },
            inputs=decision.inputs,
        )
        patch = {
            "roles": {role: {"desiredReplicas": n} for role, n in desired.items()},
            "lastScaleDecision": record.model_dump(by_alias=True),
        }
        with self.lock_for(target.key):
            self.kube.patch_status("InferenceDeployment", target.namespace, target.name, patch)
        target.written, target.written_at = desired, now
        if decision.changed:
            details = "; ".join(
                f"{role} {r.current}→{r.desired}: {r.reason}"
                for role, r in decision.roles.items()
                if r.desired != r.current
            )
            self.post_event(body, "Normal", "Scaled", details)
