"""Where the engines are: the static URL lists, or a watch of the engine pods in Kubernetes.

Kubernetes: one watch per selector (prefill, decode, unified) over the namespace's pods, in a
background thread with the synchronous `kubernetes` client (kubernetes_asyncio is not a
dependency). A pod is an engine while it is Ready, has a pod IP and is neither being deleted
nor labelled draining (`LABEL_DRAINING`: the operator is removing its group, so it gets no new
request; the label's watch event drops it at once); its URL is `http://podIP:engine_port`, its
role and compatibility hash come from the labels the operator sets (`fleetserve.api.labels`).
With `compatibility_hash` configured, pods with another hash are skipped; without it (what the
operator renders) pods of every hash are kept, and the policy pairs prefill and decode only
within one hash, so during a roll each revision serves its own requests. Each change hands the selector's whole endpoint set to the event loop
(`Fleet.update`), so a lost event heals on the next relist; a broken watch relists after a
short backoff. EndpointSlices are not used: the dev cluster's loopback pod IPs make them
unusable there.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Callable
from typing import Any

from fleetserve.api.labels import LABEL_COMPAT, LABEL_DRAINING, LABEL_ROLE
from fleetserve.api.router_config import RouterConfig
from fleetserve.router.fleet import Endpoint, Fleet
from fleetserve.router.policy import Role

__all__ = ["pod_endpoint", "run_discovery", "static_endpoints"]

logger = logging.getLogger(__name__)

WATCH_TIMEOUT_S = 60
RELIST_BACKOFF_S = (1.0, 2.0, 5.0)


def static_endpoints(config: RouterConfig) -> dict[str, list[Endpoint]]:
    """The configured URLs by source (one source per role), trailing slashes dropped."""
    roles: dict[str, tuple[str, ...]] = {
        "prefill": config.prefill, "decode": config.decode, "unified": config.engine,
    }  # fmt: skip
    return {
        f"static-{role}": [Endpoint(u.rstrip("/"), role) for u in urls]  # type: ignore[arg-type]
        for role, urls in roles.items()
    }


def pod_endpoint(
    pod: Any, role: Role, engine_port: int, compatibility_hash: str | None
) -> Endpoint | None:
    """The engine a pod (a `kubernetes.client.V1Pod`) is, or None while it must get no request:
    not Ready, no IP, being deleted, draining (its group is being removed; requests already on
    it finish there), or labelled with a role or compatibility hash not wanted."""
    meta, status = pod.metadata, pod.status
    if meta is None or status is None or meta.deletion_timestamp is not None:
        return None
    labels = meta.labels or {}
    if labels.get(LABEL_ROLE, role) != role or LABEL_DRAINING in labels:
        return None
    compat = labels.get(LABEL_COMPAT)
    if compatibility_hash is not None and compat != compatibility_hash:
        return None
    ready = any(c.type == "Ready" and c.status == "True" for c in status.conditions or [])
    if not ready or not status.pod_ip:
        return None
    if role != "unified" and not compat:
        return None  # no hash: never paired, and a P/D engine is useless unpaired
    host = f"[{status.pod_ip}]" if ":" in status.pod_ip else status.pod_ip
    return Endpoint(f"http://{host}:{engine_port}", role, compat)


async def run_discovery(config: RouterConfig, fleet: Fleet) -> None:
    """Feed `fleet` its endpoints until cancelled."""
    if config.discovery == "static":
        for source, endpoints in static_endpoints(config).items():
            fleet.update(source, endpoints)
        await asyncio.Event().wait()
        return
    loop = asyncio.get_running_loop()
    stop = threading.Event()
    selectors: dict[Role, str | None] = {
        "prefill": config.prefill_selector,
        "decode": config.decode_selector,
        "unified": config.unified_selector,
    }
    threads = []
    for role, selector in selectors.items():
        if selector is None:
            continue

        def publish(endpoints: list[Endpoint], source: str = f"k8s-{role}") -> None:
            loop.call_soon_threadsafe(fleet.update, source, endpoints)

        thread = threading.Thread(
            target=_watch_pods,
            args=(config, role, selector, publish, stop),
            name=f"router-watch-{role}",
            daemon=True,
        )
        thread.start()
        threads.append(thread)
    try:
        await asyncio.Event().wait()
    finally:
        stop.set()


def _watch_pods(
    config: RouterConfig,
    role: Role,
    selector: str,
    publish: Callable[[list[Endpoint]], None],
    stop: threading.Event,
) -> None:
    """List then watch one selector's pods, publishing the endpoint set on every change."""
    from kubernetes import client, watch
    from kubernetes import config as kube_config

    api: Any = None
    failures = 0
    while not stop.is_set():
        try:
            if api is None:  # in the pod: its service account; elsewhere: the kubeconfig
                try:
                    kube_config.load_incluster_config()
                except kube_config.ConfigException:
                    # NOTE: KUBECONFIG read now (the client reads it once, at its import).
                    kube_config.load_kube_config(config_file=os.environ.get("KUBECONFIG"))
                api = client.CoreV1Api()
            pods: Any = api.list_namespaced_pod(config.namespace, label_selector=selector)
            current: dict[str, Any] = {p.metadata.name: p for p in pods.items}
            _publish(current, role, config, publish)
            version = pods.metadata.resource_version
            failures = 0
            w = watch.Watch()
            for event in w.stream(
                api.list_namespaced_pod,
                config.namespace,
                label_selector=selector,
                resource_version=version,
                timeout_seconds=WATCH_TIMEOUT_S,
            ):
                if stop.is_set():
                    w.stop()
                    break
                pod: Any = event["object"]
                if event["type"] == "DELETED":
                    current.pop(pod.metadata.name, None)
                elif event["type"] in ("ADDED", "MODIFIED"):
                    current[pod.metadata.name] = pod
                else:  # ERROR (e.g. 410 Gone: our resource version is too old): relist
                    break
                _publish(current, role, config, publish)
        except Exception as exc:  # the watch must outlive API hiccups; it relists
            delay = RELIST_BACKOFF_S[min(failures, len(RELIST_BACKOFF_S) - 1)]
            failures += 1
            logger.warning("watching %s pods (%s) failed: %s; relisting in %g s",
                           role, selector, exc, delay)  # fmt: skip
            stop.wait(delay)


def _publish(
    pods: dict[str, Any],
    role: Role,
    config: RouterConfig,
    publish: Callable[[list[Endpoint]], None],
) -> None:
    endpoints = [
        e for p in pods.values()
        if (e := pod_endpoint(p, role, config.engine_port, config.compatibility_hash)) is not None
    ]  # fmt: skip
    publish(endpoints)
