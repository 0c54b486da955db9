"""EPLB's balancedness in the InferenceDeployment's status (`status.roles.<role>.eplbBalancedness`).

For each deployment with a role whose `eplb.enabled`, every `EPLB_STATUS_INTERVAL_S` the
operator scrapes each of the role's live group leaders' `/metrics` with the autoscaler's scraper
(`alive_leaders`, `http_scrape`: the same pods, the same timeout), reads
`fleetserve:eplb_balancedness` (each engine's last EPLB window: mean ÷ max per-rank expert
load), and writes the role's mean over its engines, rounded to `_DIGITS`, when it changed. An
engine that has not finished a window yet exports nothing and does not count; a role none of
whose engines reported keeps its last value.

One asyncio task for the operator, like the autoscaler's (and, like it, no finalizers); the
deployments come from the event handler (`track`), each tick reads the object afresh.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from fleetserve.api.labels import LABEL_DEPLOYMENT
from fleetserve.api.models import InferenceDeploymentSpec
from fleetserve.common import metric_names as names
from fleetserve.operator.autoscale.loop import alive_leaders, http_scrape
from fleetserve.operator.autoscale.replicas import effective_replicas
from fleetserve.operator.kube import Kube
from fleetserve.operator.render import ENGINE_PORT

__all__ = [
    "EPLB_STATUS_INTERVAL_S",
    "EplbStatusWatch",
    "eplb_roles",
    "parse_balancedness",
    "role_balancedness",
    "status_patch",
]

log = logging.getLogger("fleetserve.operator.eplb")

EPLB_STATUS_INTERVAL_S = 5.0
"""How often the balancedness is read (EPLB windows span thousands of steps: no need for more)."""
_DIGITS = 3
"""Status precision: a change below it is not worth a status write."""


def eplb_roles(spec: InferenceDeploymentSpec) -> list[str]:
    """The roles that run EPLB."""
    return [name for name, role in spec.roles.items() if role.eplb.enabled]


def parse_balancedness(text: str) -> float | None:
    """An engine's `fleetserve:eplb_balancedness` (mean over its series), None when absent.

    Raises:
        ValueError: text that is not the Prometheus exposition format.
    """
    values = [
        float(sample.value)
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == names.EPLB_BALANCEDNESS.sample_name
    ]
    return sum(values) / len(values) if values else None


def role_balancedness(per_engine: Mapping[str, list[float]]) -> dict[str, float]:
    """Role → the mean of its engines' values (roles with none are left out), rounded."""
    return {
        role: round(sum(values) / len(values), _DIGITS)
        for role, values in per_engine.items()
        if values
    }


def status_patch(balancedness: Mapping[str, float]) -> dict[str, Any]:
    """The merge patch of `.status` that records `balancedness` (other fields untouched)."""
    return {"roles": {role: {"eplbBalancedness": v} for role, v in sorted(balancedness.items())}}


@dataclass
class EplbStatusWatch:
    """Which deployments run EPLB, and one read-and-write round of each."""

    kube: Kube
    lock_for: Callable[[str], threading.Lock]
    scrape: Callable[[str], str] = http_scrape
    interval_s: float = EPLB_STATUS_INTERVAL_S
    targets: dict[str, tuple[str, str]] = field(default_factory=dict)
    _guard: threading.Lock = field(default_factory=threading.Lock)

    def track(self, body: dict[str, Any]) -> None:
        """Serve `body`'s deployment when a role has `eplb.enabled`, else stop serving it."""
        meta = body["metadata"]
        key = f"{meta['namespace']}/{meta['name']}"
        roles = ((body.get("spec") or {}).get("roles") or {}).values()
        wanted = not meta.get("deletionTimestamp") and any(
            ((role or {}).get("eplb") or {}).get("enabled") for role in roles
        )
        with self._guard:
            if wanted:
                self.targets[key] = (meta["namespace"], meta["name"])
            else:
                self.targets.pop(key, None)

    def forget(self, namespace: str, name: str) -> None:
        self.track({"metadata": {"namespace": namespace, "name": name}, "spec": {}})

    async def run(self, stop: asyncio.Event) -> None:
        """Tick every deployment each interval until `stop` is set."""
        while not stop.is_set():
            with self._guard:
                due = list(self.targets.values())
            for namespace, name in due:
                try:
                    await asyncio.to_thread(self.tick, namespace, name)
                except Exception as exc:  # the next tick tries again
                    log.warning("EPLB status of %s/%s failed: %r", namespace, name, exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)

    def tick(self, namespace: str, name: str) -> dict[str, float] | None:
        """Read the EPLB roles' engines and write what changed; returns the roles' values
        (None: the deployment is gone, its spec invalid, or it runs no EPLB).

        Raises:
            ApiException, urllib3 errors: API failures.
        """
        key = f"{namespace}/{name}"
        body = self.kube.get("InferenceDeployment", namespace, name)
        if body is None or body["metadata"].get("deletionTimestamp"):
            self.forget(namespace, name)
            return None
        try:
            spec = InferenceDeploymentSpec.model_validate(body["spec"])
        except ValueError:
            return None  # the reconcile reports a spec it cannot realise
        roles = eplb_roles(spec)
        if not roles:
            self.forget(namespace, name)
            return None
        current = effective_replicas(spec, body.get("status"))
        pods = self.kube.list("Pod", namespace, f"{LABEL_DEPLOYMENT}={name}")
        leaders = alive_leaders(pods, {role: current[role] for role in roles})
        per_engine: dict[str, list[float]] = {role: [] for role in roles}
        for role, by_uid in leaders.items():
            for pod in by_uid.values():
                url = f"http://{pod['status']['podIP']}:{ENGINE_PORT}/metrics"
                try:
                    value = parse_balancedness(self.scrape(url))
                except (OSError, http.client.HTTPException, ValueError) as exc:
                    log.info(
                        "EPLB scrape of %s pod %s failed: %r", key, pod["metadata"]["name"], exc
                    )
                    continue
                if value is not None:
                    per_engine[role].append(value)
        values = role_balancedness(per_engine)
        live = (body.get("status") or {}).get("roles") or {}
        changed = {
            role: v
            for role, v in values.items()
            if (live.get(role) or {}).get("eplbBalancedness") != v
        }
        if changed:
            with self.lock_for(key):
                self.kube.patch_status(
                    "InferenceDeployment", namespace, name, status_patch(changed)
                )
        return values
