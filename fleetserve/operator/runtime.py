"""Operator process state and kopf settings (held in kopf's memo, not in module globals)."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass, field

import kopf
from kubernetes import client, config

from fleetserve.operator.retries import Retries

__all__ = ["OperatorState", "api_client_from_env", "configure"]


@dataclass
class OperatorState:
    """What the handlers share: one API client, the write log, per-deployment locks, retries."""

    api: client.ApiClient
    writes: list[str] = field(default_factory=list)
    retries: Retries = field(default_factory=Retries)
    warned: dict[str, tuple[int, str, str]] = field(default_factory=dict)
    """Per deployment, the last Warning posted: (generation, reason, message). A reconcile pass
    may start from an event's stale body and find the same problem again; it is posted once per
    spec generation (forgotten when the deployment goes)."""
    _locks: dict[str, threading.Lock] = field(default_factory=dict)
    _guard: threading.Lock = field(default_factory=threading.Lock)

    def lock_for(self, key: str) -> threading.Lock:
        """One lock per InferenceDeployment: its reconciles never overlap."""
        with self._guard:
            return self._locks.setdefault(key, threading.Lock())


def api_client_from_env() -> client.ApiClient:
    """In-cluster config inside a pod, else $KUBECONFIG / ~/.kube/config."""
    cfg = client.Configuration()
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)
    else:
        config.load_kube_config(client_configuration=cfg)
    return client.ApiClient(cfg)


def configure(settings: kopf.OperatorSettings, memo: kopf.Memo) -> None:
    """Apply the operator's kopf settings and create its shared state in `memo`."""
    # NOTE: handler log lines are not posted as Kubernetes events: the reconciler posts its own
    # events (create/scale/roll/phase) and every extra event would be a write per pass.
    settings.posting.level = logging.WARNING
    settings.watching.server_timeout = 60
    settings.networking.error_backoffs = [0.5, 1, 2, 5]
    settings.batching.error_delays = [0.5, 1, 2, 5]
    settings.execution.max_workers = 8
    if getattr(memo, "state", None) is None:
        memo.state = OperatorState(api=api_client_from_env())
