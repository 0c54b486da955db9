"""The operator's error policy against the dev cluster (review guideline 13).

A spec the operator cannot realise ends in phase Failed with a Ready=False condition saying why,
one Warning event, and no further writes until the spec changes. A transient API failure (here a
real 500 from the API server: an admission webhook it cannot reach refuses every StatefulSet in
the test's namespace) is retried with growing delays, and converges once the failure clears,
although nothing changes on the InferenceDeployment to trigger another event.
"""

from __future__ import annotations

import copy
import itertools
import json
import time
from datetime import datetime
from typing import Any

import pytest
import yaml

from fleetserve.operator.errors import RETRY_DELAYS_S
from tests.devcluster.helpers import poll
from tests.test_operator.helpers import OperatorEnv

pytestmark = pytest.mark.k8s

SEL = "fleetserve.io/deployment"


def _doc(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "fleetserve.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": name},
        "spec": {"engine": {"cpu": "10m", "memory": "16Mi"}, **spec},
    }


def _status(env: OperatorEnv, ns: str, name: str) -> dict[str, Any]:
    return (env.get("inferencedeployment", ns, name) or {}).get("status") or {}


def _condition(env: OperatorEnv, ns: str, name: str, kind: str) -> dict[str, Any]:
    return next((c for c in _status(env, ns, name).get("conditions", []) if c["type"] == kind), {})


def _generation(env: OperatorEnv, ns: str, name: str) -> int:
    return int(env.get("inferencedeployment", ns, name)["metadata"]["generation"])


def _warnings(env: OperatorEnv, ns: str, name: str) -> list[dict[str, Any]]:
    """The Warning events on the InferenceDeployment (the control plane posts its own, e.g.
    ClusterIPNotAllocated, on the router Service, which has the same name)."""
    selector = f"type=Warning,involvedObject.kind=InferenceDeployment,involvedObject.name={name}"
    out = env.kubectl("get", "events", "-n", ns, "--field-selector", selector, "-o", "json")
    items: list[dict[str, Any]] = json.loads(out.stdout)["items"]
    return items


def _engine_children(env: OperatorEnv, ns: str, name: str) -> list[str]:
    items = env.get("statefulset", ns, selector=f"{SEL}={name}") or {"items": []}
    return [i["metadata"]["name"] for i in items["items"]]


BAD_URI = {
    "model": {"name": "m", "source": {"uri": "s3://bucket/m"}},
    "roles": {"prefill": {"gpusPerPod": 0}, "decode": {"gpusPerPod": 0}},
}
MIXED_DEVICES = {
    "model": {"name": "m", "source": {"uri": "/m"}},
    "roles": {"prefill": {"gpusPerPod": 0}, "decode": {"gpusPerPod": 1}},
}


@pytest.mark.parametrize(
    ("spec", "message", "fix"),
    [
        (
            BAD_URI,
            "model.source.uri must be pvc://, hostpath:// or an absolute path, got 's3://bucket/m'",
            {"model": {"name": "m", "source": {"uri": "/m"}}},
        ),
        (
            MIXED_DEVICES,
            "set model.dtype explicitly, or give the roles matching devices",
            {"model": {"name": "m", "source": {"uri": "/m"}, "dtype": "float32"}},
        ),
    ],
    ids=["bad-model-uri", "auto-dtype-on-mixed-devices"],
)
def test_an_unrealisable_spec_fails_once_and_waits_for_a_new_spec(
    operator_env: OperatorEnv, spec: dict[str, Any], message: str, fix: dict[str, Any]
) -> None:
    env = operator_env
    name = "unrealisable"
    ns = env.new_namespace(f"failed-{len(message)}")
    try:
        doc = _doc(name, spec)
        env.apply(ns, doc)
        poll("phase Failed", lambda: _status(env, ns, name).get("phase") == "Failed")
        st = _status(env, ns, name)
        assert st["observedGeneration"] == _generation(env, ns, name)
        ready = _condition(env, ns, name, "Ready")
        assert (ready["status"], ready["reason"]) == ("False", "InvalidSpec")
        assert message in ready["message"], ready
        assert _condition(env, ns, name, "Progressing")["status"] == "False"
        warnings = poll("a Warning event", lambda: _warnings(env, ns, name))
        assert [(w["reason"], w["message"]) for w in warnings] == [
            ("InvalidSpec", ready["message"])
        ]
        assert _engine_children(env, ns, name) == []
        if spec is MIXED_DEVICES:
            roles = st["roles"]
            assert roles["prefill"]["compatibilityHash"] != roles["decode"]["compatibilityHash"]
        # No hot loop: with the spec unchanged nothing is retried or rewritten, however long.
        before = env.writes(ns)
        assert [w["objectRef"].get("subresource") for w in before] == ["status"], before
        env.kubectl("annotate", "infd", "-n", ns, name, "touch=1")  # an event, same spec
        time.sleep(sum(RETRY_DELAYS_S[:3]) + 1)  # three retries would have run by now
        assert env.writes(ns) == before
        assert len(_warnings(env, ns, name)) == 1
        assert f"{ns}/{name} failed" not in env.log_text()
        # A new spec is reconciled at once.
        fixed = copy.deepcopy(doc)
        fixed["spec"].update(fix)
        env.apply(ns, fixed)
        poll(
            "Ready after the fix",
            lambda: _status(env, ns, name).get("phase") == "Ready",
            timeout_s=60,
        )
        assert _condition(env, ns, name, "Ready")["status"] == "True"
        assert _status(env, ns, name)["observedGeneration"] == _generation(env, ns, name)
        assert sorted(_engine_children(env, ns, name)) == [f"{name}-decode-0", f"{name}-prefill-0"]
    finally:
        env.delete_namespace(ns)


def _refusing_webhook(ns: str) -> dict[str, Any]:
    """Admission of StatefulSet creations in `ns` through a webhook nobody serves: HTTP 500."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": f"unreachable-{ns}"},
        "webhooks": [
            {
                "name": "unreachable.fleetserve.test",
                "clientConfig": {"url": "https://127.0.0.1:1/validate"},
                "rules": [
                    {
                        "apiGroups": ["apps"],
                        "apiVersions": ["v1"],
                        "operations": ["CREATE"],
                        "resources": ["statefulsets"],
                    }
                ],
                "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": ns}},
                "failurePolicy": "Fail",
                "sideEffects": "None",
                "admissionReviewVersions": ["v1"],
                "timeoutSeconds": 1,
            }
        ],
    }


def _probe_statefulset(ns: str) -> str:
    sts = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": {"name": "probe", "namespace": ns},
        "spec": {
            "serviceName": "probe",
            "selector": {"matchLabels": {"app": "probe"}},
            "template": {
                "metadata": {"labels": {"app": "probe"}},
                "spec": {"containers": [{"name": "c", "image": "i"}]},
            },
        },
    }
    return yaml.safe_dump(sts)


def _failed_sts_writes(env: OperatorEnv, ns: str) -> list[datetime]:
    return [
        datetime.fromisoformat(w["requestReceivedTimestamp"].replace("Z", "+00:00"))
        for w in env.writes(ns)
        if w["objectRef"]["resource"] == "statefulsets" and w["responseStatus"]["code"] == 500
    ]


def test_a_transient_api_failure_is_retried_with_a_delay(operator_env: OperatorEnv) -> None:
    env = operator_env
    name = "flaky"
    ns = env.new_namespace("transient")
    webhook = _refusing_webhook(ns)
    try:
        env.kubectl("apply", "-f", "-", stdin=yaml.safe_dump(webhook))

        def webhook_active() -> bool:
            out = env.kubectl(
                "create", "--dry-run=server", "-f", "-", stdin=_probe_statefulset(ns), check=False
            )
            return out.returncode != 0 and "failed calling webhook" in out.stderr

        poll("the webhook refusing StatefulSets", webhook_active)
        env.apply(
            ns,
            _doc(
                name,
                {
                    "model": {"name": "m", "source": {"uri": "/m"}},
                    "roles": {"prefill": {"gpusPerPod": 0}, "decode": {"gpusPerPod": 0}},
                },
            ),
        )
        attempts = sum(RETRY_DELAYS_S[:3])
        failed = poll(
            "four failed attempts",
            lambda: len(_failed_sts_writes(env, ns)) >= 4 or None,
            timeout_s=attempts + 20,
        )
        assert failed
        times = _failed_sts_writes(env, ns)
        gaps = [(b - a).total_seconds() for a, b in itertools.pairwise(times)]
        print(f"\nfailed StatefulSet creates (HTTP 500), seconds apart: {gaps}")
        for gap, delay in zip(gaps, RETRY_DELAYS_S, strict=False):
            assert delay * 0.9 <= gap < delay + 3.0, (gaps, RETRY_DELAYS_S)
        assert _status(env, ns, name).get("phase") != "Failed"  # transient, not the spec's fault
        assert f"reconcile {ns}/{name} failed" in env.log_text()
        # The failure clears; nothing touches the InferenceDeployment: only a retry can finish.
        env.kubectl("delete", "validatingwebhookconfiguration", webhook["metadata"]["name"])
        poll("Ready once the API server accepts StatefulSets",
             lambda: _status(env, ns, name).get("phase") == "Ready", timeout_s=60)  # fmt: skip
        assert sorted(_engine_children(env, ns, name)) == [f"{name}-decode-0", f"{name}-prefill-0"]
        assert [(w["reason"], w["message"]) for w in _warnings(env, ns, name)] == [
            (
                "TransferRequirementsUnmet",
                "kvTransfer.numThreads 4 exceeds engine.cpu 10m: transfer threads would contend"
                " with the engine for the pod's CPUs",
            )
        ], "no Warning but the transfer check's, posted once"
    finally:
        env.kubectl(
            "delete", "validatingwebhookconfiguration", webhook["metadata"]["name"],
            "--ignore-not-found",
        )  # fmt: skip
        env.delete_namespace(ns)
