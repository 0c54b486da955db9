"""kopf handlers: thin wrappers that read the event and call the pure reconcile.

Only `on.event` handlers are used, so kopf writes no progress annotations and no finalizers;
deletion is left to owner references and the garbage collector.
"""

from __future__ import annotations

from typing import Any, cast

import kopf

from fleetserve.api.models import GROUP, PLURAL, VERSION
from fleetserve.operator.builders import LABEL_DEPLOYMENT, LABEL_GROUP
from fleetserve.operator.kube import Kube
from fleetserve.operator.reconcile import (
    reconcile,
    recreate_group,
    restart_group_after_container_restart,
)
from fleetserve.operator.runtime import OperatorState, configure


@kopf.on.startup()
def startup(settings: kopf.OperatorSettings, memo: kopf.Memo, **_: Any) -> None:
    configure(settings, memo)


def _reconcile_body(state: OperatorState, body: dict[str, Any]) -> None:
    key = f"{body['metadata']['namespace']}/{body['metadata']['name']}"
    with state.lock_for(key):
        result = reconcile(Kube(state.api, state.writes), body)
    for kind, reason, message in result.events:
        # NOTE: kopf.event only reads apiVersion/kind/metadata, which a raw dict has.
        kopf.event(cast(Any, body), type=kind, reason=reason, message=message)


@kopf.on.event(GROUP, VERSION, PLURAL)
def on_deployment(event: kopf.RawEvent, memo: Any, **_: Any) -> None:
    obj = cast(dict[str, Any], event["object"])
    if event["type"] == "DELETED" or obj["metadata"].get("deletionTimestamp"):
        return
    _reconcile_body(memo.state, obj)


@kopf.on.event("apps", "v1", "statefulsets", labels={LABEL_DEPLOYMENT: kopf.PRESENT})
def on_group(event: kopf.RawEvent, memo: Any, **_: Any) -> None:
    meta = event["object"]["metadata"]
    kube = Kube(memo.state.api, memo.state.writes)
    parent = kube.get("InferenceDeployment", meta["namespace"], meta["labels"][LABEL_DEPLOYMENT])
    if parent is not None and not parent["metadata"].get("deletionTimestamp"):
        _reconcile_body(memo.state, parent)


@kopf.on.event("", "v1", "pods", labels={LABEL_GROUP: kopf.PRESENT})
def on_pod(event: kopf.RawEvent, memo: Any, logger: kopf.Logger, **_: Any) -> None:
    pod = cast(dict[str, Any], event["object"])
    kube = Kube(memo.state.api, memo.state.writes)
    if event["type"] == "DELETED":
        deleted = recreate_group(kube, pod)
        cause = "deleted"
    else:
        deleted = restart_group_after_container_restart(kube, pod)
        cause = "restarted a container"
    if deleted:
        logger.info(
            "recreating the group of %s (it %s): deleted %s",
            pod["metadata"]["name"],
            cause,
            deleted,
        )


__all__ = ["on_deployment", "on_group", "on_pod", "startup"]
