"""The operator against the dev cluster (kwok GPU nodes), running as its ServiceAccount.

Covers issue 6 acceptance 1 (samples → children, ranks, flags, Ready, the router's readiness
counted), 2 (admission rejects bad specs), 3 (scale, roll, group recreate, GC), 4 (RBAC proof: no
403, nothing unused) and 6 (restart converges, no writes when unchanged). Tests run in file order;
the RBAC proof comes last (the error-policy tests in test_error_policy_k8s.py run before it).
"""

from __future__ import annotations

import copy
import json
import time
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from fleetserve.api.compat import role_compatibility_hashes
from fleetserve.api.models import InferenceDeploymentSpec
from fleetserve.devcluster import kube as devkube
from fleetserve.operator.builders import ROUTER_POD_RULES, Owner, build_children
from fleetserve.operator.kube import Kube
from tests.devcluster.helpers import poll
from tests.test_operator.helpers import SA_USER, OperatorEnv

pytestmark = pytest.mark.k8s

ROOT = Path(__file__).resolve().parents[2]
SEL = "fleetserve.io/deployment"


def _sample(name: str) -> dict[str, Any]:
    return yaml.safe_load((ROOT / "manifests" / "samples" / name).read_text())


def _status(env: OperatorEnv, ns: str, name: str) -> dict[str, Any]:
    obj = env.get("inferencedeployment", ns, name) or {}
    return obj.get("status") or {}


def _ready(env: OperatorEnv, ns: str, name: str) -> bool:
    st = _status(env, ns, name)
    conds = {c["type"]: c["status"] for c in st.get("conditions", [])}
    gen = (env.get("inferencedeployment", ns, name) or {}).get("metadata", {}).get("generation")
    return conds.get("Ready") == "True" and st.get("observedGeneration") == gen


def _children(env: OperatorEnv, ns: str, name: str) -> set[tuple[str, str]]:
    out = set()
    for kind in (
        "configmap",
        "service",
        "statefulset",
        "deployment",
        "serviceaccount",
        "role",
        "rolebinding",
    ):
        for item in (env.get(kind, ns, selector=f"{SEL}={name}") or {"items": []})["items"]:
            out.add((item["kind"], item["metadata"]["name"]))
    return out


@pytest.mark.parametrize(
    ("spec", "rule"),
    [
        (
            {"prefill": {"gpusPerPod": 8, "parallelism": {"tensor": 3}}, "decode": {}},
            "multiple of gpusPerPod",
        ),
        ({"prefill": {}, "decode": {"parallelism": {"expert": True}}}, "need a MoE model"),
        # Data parallel (issue 16): every rank in one pod, in a unified role.
        ({"prefill": {}, "decode": {"parallelism": {"data": 2}}}, "data > 1 needs a unified role"),
        (
            {"unified": {"gpusPerPod": 2, "parallelism": {"tensor": 2, "data": 2}}},
            "data > 1 runs every data-parallel rank in one pod",
        ),
        ("autoscaling", "autoscaling min must be <= max"),
        ("connector", 'Unsupported value: "foo"'),
        ("rdma", "protocol rdma needs the mooncake connector"),
        ("quantity", "spec.router.memory in body should match"),
    ],
)
def test_invalid_specs_rejected_at_admission(
    operator_env: OperatorEnv, spec: Any, rule: str
) -> None:
    body: dict[str, Any] = {
        "model": {"name": "m", "source": {"uri": "/m"}},
        "roles": {"prefill": {}, "decode": {}},
    }
    if spec == "autoscaling":
        body["autoscaling"] = {"enabled": True, "decode": {"min": 3, "max": 1}}
    elif spec == "connector":
        body["kvTransfer"] = {"connector": "foo"}
    elif spec == "rdma":
        body["kvTransfer"] = {"connector": "tcp", "protocol": "rdma"}
    elif spec == "quantity":
        body["router"] = {"memory": "1Gb"}
    else:
        body["roles"] = spec
    doc = {
        "apiVersion": "fleetserve.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "bad"},
        "spec": body,
    }
    out = operator_env.kubectl(
        "apply", "-n", "default", "-f", "-", stdin=yaml.safe_dump(doc), check=False
    )
    assert out.returncode != 0 and rule in out.stderr, out.stderr
    assert operator_env.get("inferencedeployment", "default", "bad") is None


@pytest.mark.parametrize("sample", ["dense-pd.yaml", "multinode-decode.yaml", "moe-ep-eplb.yaml"])
def test_sample_renders_children_and_becomes_ready(operator_env: OperatorEnv, sample: str) -> None:
    env = operator_env
    doc = _sample(sample)
    name = doc["metadata"]["name"]
    ns = env.new_namespace(f"s-{name}")
    try:
        t0 = time.monotonic()
        env.apply(ns, doc)
        live = env.get("inferencedeployment", ns, name)
        spec = InferenceDeploymentSpec.model_validate(live["spec"])
        desired = build_children(spec, Owner(name, ns, live["metadata"]["uid"]))
        want = {(c["kind"], c["metadata"]["name"]) for c in desired}
        poll("children", lambda: _children(env, ns, name) == want)
        t_children = time.monotonic() - t0
        poll("Ready=True", lambda: _ready(env, ns, name), timeout_s=60)
        print(f"{sample}: children in {t_children:.2f}s, Ready in {time.monotonic() - t0:.2f}s")
        # The operator's log (its CLI, as in its pod) names the object each handler line is about.
        assert f"[{ns}/{name}] Handler 'on_inferencedeployment_event' succeeded" in env.log_text()
        st = _status(env, ns, name)
        hashes = role_compatibility_hashes(spec)
        for role_name, role in spec.roles.items():
            assert st["roles"][role_name] == {
                "replicas": role.replicas,
                "readyReplicas": role.replicas,
                "updatedReplicas": role.replicas,
                "groupSize": role.group_size,
                "compatibilityHash": hashes[role_name],
            }
        assert st["router"] == {"replicas": 1, "readyReplicas": 1}
        assert st["phase"] == "Ready"
        sts_by_name = {c["metadata"]["name"]: c for c in desired if c["kind"] == "StatefulSet"}
        pods = env.get("pod", ns, selector=f"{SEL}={name},fleetserve.io/group")["items"]
        assert len(pods) == sum(r.replicas * r.group_size for _, r in spec.roles.items())
        for pod in pods:
            labels = pod["metadata"]["labels"]
            group = f"{name}-{labels['fleetserve.io/role']}-{labels['fleetserve.io/group']}"
            want_c = sts_by_name[group]["spec"]["template"]["spec"]["containers"][0]
            c = pod["spec"]["containers"][0]
            assert pod["spec"]["nodeName"].startswith("gpu-node-")
            assert c["args"] == want_c["args"]
            assert [e["name"] for e in c["env"]] == [e["name"] for e in want_c["env"]]
            assert (
                c["resources"]["limits"]["nvidia.com/gpu"]
                == want_c["resources"]["limits"]["nvidia.com/gpu"]
            )
            assert pod["metadata"]["name"] == f"{group}-{labels['apps.kubernetes.io/pod-index']}"
            assert labels["fleetserve.io/compatibility-hash"] == st["compatibilityHash"]
            assert (
                st["roles"][labels["fleetserve.io/role"]]["compatibilityHash"]
                == (st["compatibilityHash"])
            )
        conditions = {c["type"]: c for c in st["conditions"]}
        assert conditions["TransferReady"]["status"] == "True", conditions["TransferReady"]
        for pod in pods:
            c = pod["spec"]["containers"][0]
            assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"]
            assert {"name": "dshm", "mountPath": "/dev/shm"} in [
                {k: m[k] for k in ("name", "mountPath")} for m in c["volumeMounts"]
            ]
        table = env.kubectl("get", "infd", "-n", ns, name).stdout
        assert "Ready" in table.splitlines()[1] and "True" in table.splitlines()[1], table
    finally:
        env.delete_namespace(ns)


def test_scale_roll_recreate_and_delete(operator_env: OperatorEnv) -> None:
    env = operator_env
    doc = _sample("dense-pd.yaml")
    # kwok pods run no engine, so a drain could never read their in-flight count: end it at
    # the first look (test_drain_k8s.py drains real engines).
    for role in doc["spec"]["roles"].values():
        role["drainTimeoutSeconds"] = 0
    name = doc["metadata"]["name"]
    ns = env.new_namespace("scale")
    try:
        env.apply(ns, doc)
        poll("Ready", lambda: _ready(env, ns, name), timeout_s=60)
        scaled = copy.deepcopy(doc)
        scaled["spec"]["roles"]["decode"]["replicas"] = 3
        env.apply(ns, scaled)
        poll(
            "3 decode groups ready",
            lambda: (
                _ready(env, ns, name)
                and _status(env, ns, name)["roles"]["decode"]["readyReplicas"] == 3
            ),
            timeout_s=60,
        )
        assert {n for k, n in _children(env, ns, name) if k == "StatefulSet"} == {
            f"{name}-prefill-0",
            f"{name}-prefill-1",
            f"{name}-decode-0",
            f"{name}-decode-1",
            f"{name}-decode-2",
        }
        rolled = copy.deepcopy(scaled)
        rolled["spec"]["engine"]["image"] = "ghcr.io/fleetserve/fleetserve:0.2.0"
        env.apply(ns, rolled)
        min_ready: dict[str, int] = {"prefill": 9, "decode": 9}

        def rolled_done() -> bool:
            st = _status(env, ns, name)
            for role in ("prefill", "decode"):
                min_ready[role] = min(min_ready[role], st["roles"][role]["readyReplicas"])
            items = env.get("statefulset", ns, selector=f"{SEL}={name}")["items"]
            images = {i["spec"]["template"]["spec"]["containers"][0]["image"] for i in items}
            return images == {"ghcr.io/fleetserve/fleetserve:0.2.0"} and _ready(env, ns, name)

        poll("roll", rolled_done, timeout_s=90, interval_s=0.05)
        assert min_ready["prefill"] >= 1 and min_ready["decode"] >= 1, min_ready
        # Scale down through the role's scale subresource (as an HPA or `kubectl scale` would):
        # the operator carries it into the deployment's spec.
        env.kubectl("scale", "-n", ns, f"infdrole/{name}-decode", "--replicas", "1")
        poll("the scale in the spec",
             lambda: env.get("infd", ns, name)["spec"]["roles"]["decode"]["replicas"] == 1,
             timeout_s=60)  # fmt: skip

        # A roll replaces groups by new ones (new indices), so count them per role.
        def groups_per_role() -> dict[str, int]:
            items = env.get("statefulset", ns, selector=f"{SEL}={name}")["items"]
            roles = [i["metadata"]["labels"]["fleetserve.io/role"] for i in items]
            return {r: roles.count(r) for r in ("prefill", "decode")}

        poll("scale down", lambda: groups_per_role() == {"prefill": 2, "decode": 1})
        env.kubectl("delete", "infd", "-n", ns, name)
        poll("garbage collection", lambda: not _children(env, ns, name), timeout_s=60)
        pods = poll(
            "pods gone",
            lambda: not (env.get("pod", ns, selector=SEL) or {"items": [1]})["items"] or None,
            timeout_s=60,
        )
        assert pods
    finally:
        env.delete_namespace(ns)


def test_killing_one_pod_recreates_the_whole_group(operator_env: OperatorEnv) -> None:
    env = operator_env
    doc = _sample("multinode-decode.yaml")
    name = doc["metadata"]["name"]
    ns = env.new_namespace("recreate")
    try:
        env.apply(ns, doc)
        poll("Ready", lambda: _ready(env, ns, name), timeout_s=60)
        leader = env.get("pod", ns, f"{name}-decode-0-0")
        env.kubectl("delete", "pod", "-n", ns, f"{name}-decode-0-1", "--wait=false")

        def leader_replaced() -> bool:
            pod = env.get("pod", ns, f"{name}-decode-0-0")
            return bool(pod) and pod["metadata"]["uid"] != leader["metadata"]["uid"]

        poll("leader recreated with its group", leader_replaced, timeout_s=60)
        poll("Ready again", lambda: _ready(env, ns, name), timeout_s=60)
    finally:
        env.delete_namespace(ns)


def _pod(env: OperatorEnv, ns: str, name: str) -> dict[str, Any]:
    pod = env.get("pod", ns, name)
    assert pod is not None, f"pod {ns}/{name} not found"
    return cast(dict[str, Any], pod)


def _report_container_restart(env: OperatorEnv, ns: str, pod_name: str, ran_s: int) -> None:
    """Write what the kubelet writes when the engine container died after `ran_s` seconds."""
    pod = _pod(env, ns, pod_name)
    created = datetime.fromisoformat(pod["metadata"]["creationTimestamp"].replace("Z", "+00:00"))
    stamp = (created + timedelta(seconds=ran_s)).strftime("%Y-%m-%dT%H:%M:%SZ")
    statuses = pod["status"]["containerStatuses"]
    for status in statuses:
        status["restartCount"] = 1
        status["lastState"] = {
            "terminated": {"exitCode": 1, "reason": "Error", "finishedAt": stamp,
                           "startedAt": pod["metadata"]["creationTimestamp"]}
        }  # fmt: skip
    patch = json.dumps({"status": {"containerStatuses": statuses}})
    env.kubectl("patch", "pod", "-n", ns, pod_name, "--subresource=status", "--type=merge",
                "-p", patch)  # fmt: skip


def test_a_container_restart_recreates_the_whole_group(operator_env: OperatorEnv) -> None:
    """LeaderWorkerSet's RecreateGroupOnPodRestart: a rank that restarted alone cannot rejoin."""
    env = operator_env
    doc = _sample("multinode-decode.yaml")
    name = doc["metadata"]["name"]
    ns = env.new_namespace("restart-group")
    try:
        env.apply(ns, doc)
        poll("Ready", lambda: _ready(env, ns, name), timeout_s=60)
        uids = {p: _pod(env, ns, p)["metadata"]["uid"] for p in (f"{name}-decode-0-0",
                                                                f"{name}-decode-0-1")}  # fmt: skip
        # A crash right at start-up is left to the kubelet's back-off: nothing is recreated.
        _report_container_restart(env, ns, f"{name}-decode-0-1", ran_s=5)
        time.sleep(3)
        assert all(_pod(env, ns, p)["metadata"]["uid"] == uid for p, uid in uids.items())
        # A crash after the group ran a while restarts every rank, the leader included.
        _report_container_restart(env, ns, f"{name}-decode-0-1", ran_s=120)

        def all_replaced() -> bool:
            pods = {p: env.get("pod", ns, p) for p in uids}
            return all(pod and pod["metadata"]["uid"] != uids[p] for p, pod in pods.items())

        poll("the whole group recreated", all_replaced, timeout_s=60)
        poll("Ready again", lambda: _ready(env, ns, name), timeout_s=60)
        restarted = _pod(env, ns, f"{name}-decode-0-1")
        assert [s["restartCount"] for s in restarted["status"]["containerStatuses"]] == [0]
    finally:
        env.delete_namespace(ns)


def test_a_delete_by_uid_spares_another_incarnation(operator_env: OperatorEnv) -> None:
    """The operator deletes a group's pods by uid: against the API server, a delete naming the
    uid of an object since recreated under the same name leaves the new one alone."""
    env = operator_env
    ns = env.new_namespace("delete-by-uid")
    svc = {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "twin", "namespace": ns},
           "spec": {"ports": [{"port": 80}]}}  # fmt: skip
    try:
        with devkube.api_client(env.dc.kubeconfig) as api:
            kube = Kube(api)
            env.apply(ns, svc)
            old_uid = env.get("service", ns, "twin")["metadata"]["uid"]
            env.kubectl("delete", "service", "-n", ns, "twin")
            env.apply(ns, svc)
            new_uid = env.get("service", ns, "twin")["metadata"]["uid"]
            assert new_uid != old_uid
            assert kube.delete("Service", ns, "twin", uid=old_uid) is False
            assert env.get("service", ns, "twin")["metadata"]["uid"] == new_uid
            assert kube.delete("Service", ns, "twin", uid=new_uid) is True
            poll("the service deleted", lambda: env.get("service", ns, "twin") is None,
                 timeout_s=30)  # fmt: skip
            assert kube.delete("Service", ns, "twin", uid=new_uid) is False
    finally:
        env.delete_namespace(ns)


def test_restart_converges_and_unchanged_resource_costs_no_writes(
    operator_env: OperatorEnv,
) -> None:
    env = operator_env
    doc = _sample("dense-pd.yaml")
    name = doc["metadata"]["name"]
    ns = env.new_namespace("restart")
    try:
        env.apply(ns, doc)
        poll("first writes", lambda: env.writes(ns), interval_s=0.01)
        env.stop(kill=True)  # mid-reconcile
        env.start()
        poll("Ready after restart", lambda: _ready(env, ns, name), timeout_s=60)
        assert len([k for k, _ in _children(env, ns, name) if k == "StatefulSet"]) == 3
        time.sleep(2)
        before = len(env.writes(ns))
        env.stop()
        env.start()  # a restart re-lists everything: a full reconcile of an unchanged resource
        time.sleep(5)
        env.kubectl("annotate", "infd", "-n", ns, name, "touch=1")  # another no-op event
        time.sleep(3)
        assert _ready(env, ns, name)
        assert env.writes(ns)[before:] == []
    finally:
        env.delete_namespace(ns)


def test_switching_roles_replaces_their_groups_and_status(operator_env: OperatorEnv) -> None:
    env = operator_env
    role = {"replicas": 1, "gpusPerPod": 0}
    doc = {
        "apiVersion": "fleetserve.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "switch"},
        "spec": {
            "model": {"name": "m", "source": {"uri": "/m"}},
            "engine": {"cpu": "10m", "memory": "16Mi"},
            "roles": {"prefill": role, "decode": role},
        },
    }
    ns = env.new_namespace("switch-roles")
    try:
        env.apply(ns, doc)
        poll("Ready as prefill/decode", lambda: _ready(env, ns, "switch"), timeout_s=60)
        assert set(_status(env, ns, "switch")["roles"]) == {"prefill", "decode"}
        unified = copy.deepcopy(doc)
        unified["spec"]["roles"] = {"unified": {**role, "replicas": 2}}
        unified["spec"]["kvTransfer"] = {"connector": "none"}
        env.apply(ns, unified)
        poll("Ready as unified", lambda: _ready(env, ns, "switch"), timeout_s=60)
        st = _status(env, ns, "switch")
        assert set(st["roles"]) == {"unified"} and st["roles"]["unified"]["readyReplicas"] == 2
        poll(
            "only the unified groups left",
            lambda: (
                {n for k, n in _children(env, ns, "switch") if k == "StatefulSet"}
                == {"switch-unified-0", "switch-unified-1"}
            ),
        )
    finally:
        env.delete_namespace(ns)


def test_transfer_requirements_the_cluster_cannot_meet_are_reported(
    operator_env: OperatorEnv,
) -> None:
    """An rdma fleet in a Pod Security 'baseline' namespace of a cluster without RDMA devices:
    the status says both, a Warning event too, and the pods are indeed rejected."""
    env = operator_env
    ns = env.new_namespace("transfer-checks")
    try:
        env.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=baseline")
        doc = {
            "apiVersion": "fleetserve.io/v1alpha1",
            "kind": "InferenceDeployment",
            "metadata": {"name": "rdma"},
            "spec": {
                "model": {"name": "m", "source": {"uri": "/m"}, "dtype": "bfloat16"},
                "kvTransfer": {"connector": "mooncake", "protocol": "rdma", "numThreads": 2},
                "roles": {"prefill": {}, "decode": {}},
            },
        }
        env.apply(ns, doc)

        def transfer_condition() -> dict[str, Any] | None:
            for c in _status(env, ns, "rdma").get("conditions", []):
                if c["type"] == "TransferReady":
                    return dict(c)
            return None

        poll("TransferReady reported", lambda: transfer_condition() is not None)
        cond = transfer_condition()
        assert cond is not None and cond["status"] == "False", cond
        assert cond["reason"] == "TransferRequirementsUnmet"
        assert "Pod Security 'baseline'" in cond["message"] and "IPC_LOCK" in cond["message"]
        assert "'rdma/hca'" in cond["message"]

        def events(reason: str) -> list[dict[str, Any]]:
            items = (env.get("events", ns) or {"items": []})["items"]
            return [e for e in items if e.get("reason") == reason]

        poll("Warning event", lambda: events("TransferRequirementsUnmet"))
        assert events("TransferRequirementsUnmet")[0]["type"] == "Warning"
        # What the warning predicted: admission rejects the engine pods.
        poll("pods rejected", lambda: events("FailedCreate"), timeout_s=30)
        assert any("IPC_LOCK" in e["message"] for e in events("FailedCreate"))
        sts = env.get("statefulset", ns, "rdma-decode-0")
        limits = sts["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]
        assert limits["rdma/hca"] == "1"
    finally:
        env.delete_namespace(ns)


def test_rbac_is_sufficient_and_minimal(operator_env: OperatorEnv) -> None:
    events = operator_env.dc.audit_events(username=SA_USER)
    assert operator_env.rbac_denials() == []
    assert len(events) > 100, "the operator ran as the ServiceAccount"
    used = {
        (
            e["objectRef"]["resource"]
            + ("/" + e["objectRef"]["subresource"] if e["objectRef"].get("subresource") else ""),
            e["verb"],
        )
        for e in events
        if "objectRef" in e
    }
    # NOTE: server-side apply of a missing object audits as `patch` (201) but is authorised as
    # `create` too, so `create` counts as used wherever `patch` created something.
    created = {
        (e["objectRef"]["resource"], "create")
        for e in events
        if e["verb"] == "patch" and e["responseStatus"]["code"] == 201
    }
    rbac = list(yaml.safe_load_all((ROOT / "manifests" / "operator" / "rbac.yaml").read_text()))
    rules = next(d for d in rbac if d["kind"] == "ClusterRole")["rules"]
    granted = {(r, v) for rule in rules for r in rule["resources"] for v in rule["verbs"]}
    # Held only to be granted: RBAC lets the operator create the router's Role only while it
    # holds every permission that Role grants (it has neither `escalate` nor `bind`).
    assert ("roles", "create") in created and ("rolebindings", "create") in created
    passed_on = {
        (r, v) for rule in ROUTER_POD_RULES for r in rule["resources"] for v in rule["verbs"]
    }
    assert granted - used - created - passed_on == set()
