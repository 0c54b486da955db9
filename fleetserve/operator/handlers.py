"""kopf handlers: thin wrappers that read the event and call the pure reconcile.

Only `on.event` handlers are used, so kopf writes no progress annotations and no finalizers;
deletion is left to owner references and the garbage collector. kopf does not retry event
handlers, so failed work goes through `OperatorState.retries` (delayed, per object): a transient
API failure is retried with a growing delay, while a spec the operator cannot realise ends in
phase Failed inside the reconcile and is not retried (`fleetserve.operator.errors`).
"""

from __future__ import annotations

import asyncio
import contextvars
from dataclasses import dataclass
from typing import Any, cast

import kopf

from fleetserve.api.labels import LABEL_DEPLOYMENT, LABEL_GROUP
from fleetserve.api.models import GROUP, PLURAL, VERSION
from fleetserve.api.role_adapter import ROLE_PLURAL
from fleetserve.operator.autoscale.loop import Autoscaler
from fleetserve.operator.autoscale.metrics import AutoscalerMetrics, serve_metrics
from fleetserve.operator.autoscale.scale_adapter import sync_role_adapters
from fleetserve.operator.eplb_status import EplbStatusWatch
from fleetserve.operator.kube import Kube
from fleetserve.operator.placement import awaits_placement
from fleetserve.operator.reconcile import (
    live_pod,
    reconcile,
    recreate_group,
    restart_group_after_container_restart,
)
from fleetserve.operator.runtime import OperatorState, configure

__all__ = [
    "PLACEMENT_REQUEUE_S",
    "on_deployment_event",
    "on_inferencedeployment_event",
    "on_operator_cleanup",
    "on_operator_startup",
    "on_pod_event",
    "on_role_adapter_event",
    "on_statefulset_event",
]

PLACEMENT_REQUEUE_S = 0.5
"""How long after a pending group pod's event its deployment is reconciled (a burst of such
events, one per pod, costs one pass)."""


def _post_event(body: dict[str, Any], kind: str, reason: str, message: str) -> None:
    # NOTE: kopf.event only reads apiVersion/kind/metadata, which a raw dict has; it is safe
    # from the autoscaler's worker threads (it hands the event to kopf's loop thread-safely).
    kopf.event(cast(Any, body), type=kind, reason=reason, message=message)


@dataclass
class _EventContext:
    """Posts kopf events from threads kopf did not start (the autoscaler's).

    kopf.event needs kopf's event-queue context variables, which its resource handlers carry
    but the startup handler (where the autoscaler task starts) does not; so a handler's context
    is kept here. One object for the operator: kopf gives each resource a shallow copy of the
    memo, which shares it.
    """

    context: contextvars.Context | None = None

    def post(self, body: dict[str, Any], kind: str, reason: str, message: str) -> None:
        if self.context is not None:
            self.context.copy().run(_post_event, body, kind, reason, message)


@kopf.on.startup()
async def on_operator_startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    configure(settings, memo)
    state: OperatorState = memo.state
    metrics = AutoscalerMetrics()
    address = getattr(memo, "metrics_address", None)
    memo.metrics_server = serve_metrics(metrics, address) if address else None
    memo.event_context = _EventContext()
    memo.autoscaler = Autoscaler(_kube(state), metrics, state.lock_for, memo.event_context.post)
    memo.autoscaler_stop = asyncio.Event()
    memo.autoscaler_task = asyncio.create_task(memo.autoscaler.run(memo.autoscaler_stop))
    memo.eplb_status = EplbStatusWatch(_kube(state), state.lock_for)
    # NOTE: one stop event ends both loops at cleanup.
    memo.eplb_status_task = asyncio.create_task(memo.eplb_status.run(memo.autoscaler_stop))


@kopf.on.cleanup()
async def on_operator_cleanup(memo: kopf.Memo, **_: Any) -> None:
    state: OperatorState | None = getattr(memo, "state", None)
    if state is not None:
        state.retries.close()
    if getattr(memo, "autoscaler_task", None) is not None:
        memo.autoscaler_stop.set()
        await memo.autoscaler_task
        memo.autoscaler.close()
    if getattr(memo, "eplb_status_task", None) is not None:
        await memo.eplb_status_task
    if getattr(memo, "metrics_server", None) is not None:
        memo.metrics_server.shutdown()


def _kube(state: OperatorState) -> Kube:
    return Kube(state.api, state.writes)


def _reconcile_body(state: OperatorState, body: dict[str, Any]) -> None:
    ns, name = body["metadata"]["namespace"], body["metadata"]["name"]
    key = f"{ns}/{name}"
    with state.lock_for(key):
        # NOTE: sync handlers run on a thread pool, so a pass for an older event can take the
        # lock after a newer one: reconcile the object as it is now, or a stale spec would undo
        # the newer pass (cancel the drain a scale-down began).
        live = _kube(state).get("InferenceDeployment", ns, name)
        if live is None or live["metadata"].get("deletionTimestamp"):
            return
        body = live
        result = reconcile(_kube(state), body)
        # NOTE: after the reconcile, under the same lock, from live reads: a scale through a
        # role's adapter is carried into the spec (and the next event reconciles it). A spec
        # the operator cannot realise (phase Failed) gets no new objects, adapters included.
        adapter_events = (
            sync_role_adapters(_kube(state), ns, name)
            if result.status.get("phase") != "Failed"
            else []
        )
    if result.requeue_after_s is not None:  # a drain in progress: look again soon
        state.retries.later(f"requeue {key}", result.requeue_after_s,
                            lambda: _reconcile(state, ns, name))  # fmt: skip
    generation = int(body["metadata"].get("generation", 1))
    for kind, reason, message in [*result.events, *adapter_events]:
        if kind == "Warning":
            if state.warned.get(key) == (generation, reason, message):
                continue
            state.warned[key] = (generation, reason, message)
        _post_event(body, kind, reason, message)


def _reconcile_live(state: OperatorState, namespace: str, name: str) -> None:
    """Reconcile the deployment as it is now (nothing to do once it is gone or going)."""
    _reconcile_body(state, {"metadata": {"namespace": namespace, "name": name}})


def _reconcile(
    state: OperatorState, namespace: str, name: str, body: dict[str, Any] | None = None
) -> None:
    """Reconcile now (the object as it is live, `_reconcile_body`); on failure retry later."""

    def live() -> None:
        _reconcile_live(state, namespace, name)

    def from_event() -> None:
        assert body is not None
        _reconcile_body(state, body)

    key = f"reconcile {namespace}/{name}"
    state.retries.run(key, from_event if body is not None else live, again=live)


@kopf.on.event(GROUP, VERSION, PLURAL)
def on_inferencedeployment_event(event: kopf.RawEvent, memo: Any, **_: Any) -> None:
    obj = cast(dict[str, Any], event["object"])
    meta = obj["metadata"]
    if event["type"] == "DELETED" or meta.get("deletionTimestamp"):
        memo.state.retries.forget(f"reconcile {meta['namespace']}/{meta['name']}")
        memo.state.warned.pop(f"{meta['namespace']}/{meta['name']}", None)
        memo.autoscaler.forget(meta["namespace"], meta["name"])
        memo.eplb_status.forget(meta["namespace"], meta["name"])
        return
    memo.event_context.context = contextvars.copy_context()
    memo.autoscaler.track(obj)
    memo.eplb_status.track(obj)
    _reconcile(memo.state, meta["namespace"], meta["name"], obj)


@kopf.on.event(GROUP, VERSION, ROLE_PLURAL)
def on_role_adapter_event(event: kopf.RawEvent, memo: Any, **_: Any) -> None:
    """A role's scale subresource changed (or its adapter went): reconcile its deployment."""
    obj = event["object"]
    deployment = (obj.get("spec") or {}).get("deployment")
    if deployment:
        _reconcile(memo.state, obj["metadata"]["namespace"], deployment)


@kopf.on.event("apps", "v1", "statefulsets", labels={LABEL_DEPLOYMENT: kopf.PRESENT})
def on_statefulset_event(event: kopf.RawEvent, memo: Any, **_: Any) -> None:
    meta = event["object"]["metadata"]
    _reconcile(memo.state, meta["namespace"], meta["labels"][LABEL_DEPLOYMENT])


@kopf.on.event("apps", "v1", "deployments", labels={LABEL_DEPLOYMENT: kopf.PRESENT})
def on_deployment_event(event: kopf.RawEvent, memo: Any, **_: Any) -> None:
    """The router Deployment: its readiness is part of the parent's Ready."""
    meta = event["object"]["metadata"]
    _reconcile(memo.state, meta["namespace"], meta["labels"][LABEL_DEPLOYMENT])


@kopf.on.event("", "v1", "pods", labels={LABEL_GROUP: kopf.PRESENT})
def on_pod_event(event: kopf.RawEvent, memo: Any, logger: kopf.Logger, **_: Any) -> None:
    pod = cast(dict[str, Any], event["object"])
    state: OperatorState = memo.state
    meta = pod["metadata"]

    def report(deleted: list[str], cause: str) -> None:
        if deleted:
            logger.info(
                "recreating the group of %s (it %s): deleted %s", meta["name"], cause, deleted
            )

    def after_delete() -> None:
        # Safe to repeat with the same body: pods created after this one are kept.
        report(recreate_group(_kube(state), pod), "deleted")

    def after_restart(current: dict[str, Any] | None = pod) -> None:
        if current is not None:
            deleted = restart_group_after_container_restart(_kube(state), current)
            report(deleted, "restarted a container")

    def after_restart_live() -> None:
        # A retry reads the pod again: once its group was recreated, the old pod is gone.
        after_restart(live_pod(_kube(state), pod))

    if event["type"] != "DELETED" and awaits_placement(pod):
        # Scheduling (bound, or Unschedulable) changes no StatefulSet status: reconcile the
        # deployment, once for a burst of pod events.
        ns, owner = meta["namespace"], meta["labels"][LABEL_DEPLOYMENT]
        state.retries.later(f"requeue {ns}/{owner}", PLACEMENT_REQUEUE_S,
                            lambda: _reconcile(state, ns, owner))  # fmt: skip
    key = f"group restart {meta['namespace']}/{meta['name']}"
    if event["type"] == "DELETED":
        state.retries.run(key, after_delete)
    else:
        state.retries.run(key, after_restart, again=after_restart_live)
