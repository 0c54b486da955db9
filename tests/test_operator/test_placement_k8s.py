"""Placement of multi-pod groups on kwok GPU nodes by the real kube-scheduler (issue 16, acc. 6).

Each test adds its own pool of fake GPU nodes, tainted and labelled so that only its
deployment's engine pods land there (the session's gpu-node-* serve the other tests), sized to
hold exactly the GPUs the deployment asks for, or too few. Without the creation order and the
packing affinity (fleetserve.operator.placement) the scheduler's default spreading leaves no
whole node for the decode group in these shapes.
"""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from fleetserve.devcluster import kube
from fleetserve.devcluster.nodes import NodeTopology, build_gpu_node
from fleetserve.devcluster.testing import DevCluster
from tests.devcluster.helpers import poll
from tests.test_operator.helpers import OperatorEnv

pytestmark = pytest.mark.k8s

POOL = "fleetserve.io/test-pool"
NAME = "place"
SEL = "fleetserve.io/deployment"


class Pool:
    """A pool of fake GPU nodes `<pool>-<i>`, tainted `POOL=<pool>:NoSchedule`."""

    def __init__(self, dc: DevCluster, env: OperatorEnv, name: str, gpus_per_node: int) -> None:
        self.dc, self.env, self.name, self.gpus = dc, env, name, gpus_per_node
        self.nodes: list[str] = []

    def add(self, count: int) -> None:
        topology = NodeTopology(gpus_per_node=self.gpus)
        manifests = []
        for _ in range(count):
            node = build_gpu_node(0, topology)
            name = f"{self.name}-{len(self.nodes)}"
            node["metadata"]["name"] = name
            node["metadata"]["labels"].update({"kubernetes.io/hostname": name, POOL: self.name})
            node["spec"] = {"taints": [{"key": POOL, "value": self.name, "effect": "NoSchedule"}]}
            manifests.append(node)
            self.nodes.append(name)
        with self.dc.api_client() as api:
            kube.create_nodes(api, manifests)
            kube.wait_nodes_ready(api, self.nodes, timeout_s=30)

    def delete(self) -> None:
        for node in self.nodes:
            self.env.kubectl("delete", "node", node, "--wait=false", check=False)

    def role(self, replicas: int, gpus_per_pod: int, **parallelism: int) -> dict[str, Any]:
        return {
            "replicas": replicas,
            "gpusPerPod": gpus_per_pod,
            "parallelism": parallelism,
            "nodeSelector": {POOL: self.name},
            "tolerations": [
                {"key": POOL, "operator": "Equal", "value": self.name, "effect": "NoSchedule"}
            ],
            # kwok pods run no engine: a scale-down ends its drain at the first look.
            "drainTimeoutSeconds": 0,
        }


def _doc(prefill: dict[str, Any], decode: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "fleetserve.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": NAME},
        "spec": {
            "model": {"name": "m", "source": {"uri": "/models/m"}},
            "kvTransfer": {"connector": "tcp"},
            "roles": {"prefill": prefill, "decode": decode},
        },
    }


def _status(env: OperatorEnv, ns: str) -> dict[str, Any]:
    return (env.get("inferencedeployment", ns, NAME) or {}).get("status") or {}


def _condition(env: OperatorEnv, ns: str, kind: str) -> dict[str, Any]:
    return next((c for c in _status(env, ns).get("conditions", []) if c["type"] == kind), {})


def _ready(env: OperatorEnv, ns: str) -> bool:
    live = env.get("inferencedeployment", ns, NAME) or {}
    st = live.get("status") or {}
    gen = live.get("metadata", {}).get("generation")
    return _condition(env, ns, "Ready").get("status") == "True" and (
        st.get("observedGeneration") == gen
    )


def _pods(env: OperatorEnv, ns: str, role: str) -> list[dict[str, Any]]:
    sel = f"{SEL}={NAME},fleetserve.io/role={role}"
    items: list[dict[str, Any]] = (env.get("pod", ns, selector=sel) or {"items": []})["items"]
    return items


def _events(env: OperatorEnv, ns: str, reason: str) -> list[str]:
    selector = f"involvedObject.kind=InferenceDeployment,involvedObject.name={NAME},reason={reason}"
    out = env.kubectl("get", "events", "-n", ns, "--field-selector", selector, "-o", "json")
    return [e["message"] for e in json.loads(out.stdout)["items"]]


def _scheduled_at(pod: dict[str, Any]) -> str:
    conditions = pod["status"].get("conditions", [])
    return next(c["lastTransitionTime"] for c in conditions if c["type"] == "PodScheduled")


def _assert_placed(env: OperatorEnv, pool: Pool, ns: str, decode_pods: int) -> None:
    """Every engine pod on the pool; each decode pod alone on its node (whole nodes)."""
    prefill, decode = _pods(env, ns, "prefill"), _pods(env, ns, "decode")
    assert len(decode) == decode_pods
    nodes = {p["spec"]["nodeName"] for p in prefill + decode}
    assert nodes <= set(pool.nodes), nodes
    decode_nodes = [p["spec"]["nodeName"] for p in decode]
    assert len(set(decode_nodes)) == len(decode_nodes), decode_nodes
    assert not {p["spec"]["nodeName"] for p in prefill} & set(decode_nodes)


@pytest.mark.parametrize(
    ("nodes", "gpus", "prefill", "decode"),
    [
        # The shape: 4 × 8 GPUs, prefill 4 × 2 GPUs, decode 1 group of 2 whole-node pods.
        (4, 8, (4, 2, {"tensor": 2}), (1, 8, {"tensor": 8, "pipeline": 2})),
        # Exactly enough: 24 GPUs for 4 × 2 + 2 × 8.
        (3, 8, (4, 2, {"tensor": 2}), (1, 8, {"tensor": 8, "pipeline": 2})),
        # Exactly enough on 4-GPU nodes: 4 × 1 prefill + one decode group of 3 whole-node pods.
        (4, 4, (4, 1, {}), (1, 4, {"tensor": 4, "pipeline": 3})),
    ],
    ids=["4x8-p4x2-d1x2x8", "3x8-p4x2-d1x2x8-exact", "4x4-p4x1-d1x3x4-exact"],
)
def test_mixed_shapes_become_ready_on_exactly_enough_gpus(
    operator_env: OperatorEnv,
    dev_cluster: DevCluster,
    nodes: int,
    gpus: int,
    prefill: tuple[int, int, dict[str, int]],
    decode: tuple[int, int, dict[str, int]],
) -> None:
    env = operator_env
    ns = env.new_namespace(f"place-{nodes}x{gpus}-{int(time.time()) % 10**6}")
    pool = Pool(dev_cluster, env, ns, gpus)
    try:
        pool.add(nodes)
        p_doc = pool.role(prefill[0], prefill[1], **prefill[2])
        d_doc = pool.role(decode[0], decode[1], **decode[2])
        env.apply(ns, _doc(p_doc, d_doc))
        poll("Ready=True", lambda: _ready(env, ns), timeout_s=90)
        group_pods = decode[2].get("tensor", 1) * decode[2].get("pipeline", 1) // decode[1]
        _assert_placed(env, pool, ns, group_pods)
        # Creation order: the prefill pods were created only once the decode group was placed.
        bound = max(_scheduled_at(p) for p in _pods(env, ns, "decode"))
        created = min(p["metadata"]["creationTimestamp"] for p in _pods(env, ns, "prefill"))
        assert bound <= created, (bound, created)
        assert _condition(env, ns, "Unschedulable")["status"] == "False"
    finally:
        env.delete_namespace(ns)
        pool.delete()


def test_packed_partial_pods_leave_whole_nodes_for_a_later_group(
    operator_env: OperatorEnv, dev_cluster: DevCluster
) -> None:
    """Prefill runs alone first; a decode group needing 2 whole nodes is added later. On 3
    nodes × 8 GPUs it fits only if the 4 × 2-GPU prefill pods packed onto one node."""
    env = operator_env
    ns = env.new_namespace(f"place-pack-{int(time.time()) % 10**6}")
    pool = Pool(dev_cluster, env, ns, 8)
    try:
        pool.add(3)
        doc = _doc(pool.role(4, 2, tensor=2), pool.role(0, 8, tensor=8, pipeline=2))
        env.apply(ns, doc)
        poll("prefill Ready", lambda: _ready(env, ns), timeout_s=90)
        prefill_nodes = {p["spec"]["nodeName"] for p in _pods(env, ns, "prefill")}
        assert len(prefill_nodes) == 1, prefill_nodes
        doc["spec"]["roles"]["decode"]["replicas"] = 1
        env.apply(ns, doc)
        poll("Ready with the decode group", lambda: _ready(env, ns), timeout_s=90)
        assert _status(env, ns)["roles"]["decode"]["readyReplicas"] == 1
        _assert_placed(env, pool, ns, 2)
    finally:
        env.delete_namespace(ns)
        pool.delete()


def test_too_few_gpus_names_the_unschedulable_groups_until_nodes_arrive(
    operator_env: OperatorEnv, dev_cluster: DevCluster
) -> None:
    """2 × 8 GPUs for 2 × 2 prefill + 2 × 8 decode: the decode group takes both nodes, the
    status names the prefill groups and the scheduler's reason; a third node clears it."""
    env = operator_env
    ns = env.new_namespace(f"place-few-{int(time.time()) % 10**6}")
    pool = Pool(dev_cluster, env, ns, 8)
    try:
        pool.add(2)
        env.apply(ns, _doc(pool.role(2, 2, tensor=2), pool.role(1, 8, tensor=8, pipeline=2)))
        # NOTE: the condition names each group once the scheduler has judged its pods; on a busy
        # machine group 1's may come a poll after group 0's, so wait for both to be named.
        stuck = poll(
            "Unschedulable=True naming both prefill groups",
            lambda: (
                (c := _condition(env, ns, "Unschedulable")).get("status") == "True"
                and "prefill group 1: " in c.get("message", "")
                and c
            ),
            timeout_s=60,
        )
        message = stuck["message"]
        assert "prefill group 0: " in message and "prefill group 1: " in message, message
        assert "Insufficient nvidia.com/gpu" in message, message
        assert "decode group" not in message, message
        assert _condition(env, ns, "Ready")["status"] == "False"
        poll("an Unschedulable event", lambda: _events(env, ns, "Unschedulable"), timeout_s=30)
        assert {p["spec"].get("nodeName") for p in _pods(env, ns, "decode")} == set(pool.nodes)

        pool.add(1)
        poll("Ready=True", lambda: _ready(env, ns), timeout_s=90)
        cleared = _condition(env, ns, "Unschedulable")
        assert cleared["status"] == "False", cleared
        poll("a Placed event", lambda: _events(env, ns, "Placed"), timeout_s=30)
        _assert_placed(env, pool, ns, 2)
    finally:
        env.delete_namespace(ns)
        pool.delete()


def test_unplaceable_whole_node_group_holds_the_partial_groups(
    operator_env: OperatorEnv, dev_cluster: DevCluster
) -> None:
    """One 8-GPU node for a decode group of 2 whole-node pods: the status names the decode
    group and says the prefill groups wait for it; no prefill group takes the node's GPUs."""
    env = operator_env
    ns = env.new_namespace(f"place-hold-{int(time.time()) % 10**6}")
    pool = Pool(dev_cluster, env, ns, 8)
    try:
        pool.add(1)
        env.apply(ns, _doc(pool.role(2, 2, tensor=2), pool.role(1, 8, tensor=8, pipeline=2)))
        stuck = poll(
            "Unschedulable=True",
            lambda: (c := _condition(env, ns, "Unschedulable")).get("status") == "True" and c,
            timeout_s=60,
        )
        message = stuck["message"]
        assert message.startswith("decode group 0: 0/"), message
        assert "Insufficient nvidia.com/gpu" in message, message
        assert message.endswith("new prefill groups wait for decode group 0"), message
        assert _pods(env, ns, "prefill") == []
        sts = env.get("statefulset", ns, selector=f"{SEL}={NAME}")["items"]
        assert [s["metadata"]["name"] for s in sts] == [f"{NAME}-decode-0"]
    finally:
        env.delete_namespace(ns)
        pool.delete()
