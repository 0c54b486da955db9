"""EPLB on the dev cluster (issue 17, acceptance 4): the MoE sample's status shows its engines'
balancedness, and the API server refuses redundant experts that do not divide the EP group.

The sample (manifests/samples/moe-ep-eplb.yaml) keeps its roles, parallelism and eplb blocks;
its engines are simulated (`fleetserve.operator.autoscale.sim_pod`: the rendered engine flags,
EPLB's included, are its command line) on the local node, which advertises the GPUs the roles
ask for. The operator, with its own ServiceAccount, scrapes their /metrics and writes
`status.roles.<role>.eplbBalancedness`.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleetserve.operator.autoscale.sim_eplb import load_time_balancedness
from tests.devcluster.helpers import poll
from tests.test_operator.helpers import OperatorEnv

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
GPU = "nvidia.com/gpu"
LOCAL = {
    "nodeSelector": {"fleetserve.io/local-node": "true"},
    "tolerations": [
        {"key": "fleetserve.io/local-node", "operator": "Exists", "effect": "NoSchedule"}
    ],
}


def _advertise_gpus(env: OperatorEnv, count: int | None) -> None:
    value = None if count is None else str(count)
    patch = {"status": {"capacity": {GPU: value}, "allocatable": {GPU: value}}}
    env.kubectl("patch", "node", env.dc.local_node, "--subresource=status", "--type=merge",
                "-p", json.dumps(patch))  # fmt: skip


def _sim_sample(trace: Path, peers: Path) -> dict[str, Any]:
    doc = yaml.safe_load((ROOT / "manifests" / "samples" / "moe-ep-eplb.yaml").read_text())
    spec = doc["spec"]
    spec["model"]["source"] = {"uri": "/sim"}
    spec["engine"] = {
        "command": [sys.executable, "-m", "fleetserve.operator.autoscale.sim_pod"],
        "args": {"sim-trace": str(trace), "sim-peers": str(peers)},
        "cpu": "10m",
        "memory": "64Mi",
    }
    for role in spec["roles"].values():
        role.update(LOCAL)
    spec["router"] = {"replicas": 0}  # a router is ready only after a real generation
    return doc


def test_the_moe_sample_status_shows_the_engines_balancedness(
    operator_env: OperatorEnv, tmp_path: Path
) -> None:
    env = operator_env
    trace, peers = tmp_path / "trace.json", tmp_path / "peers"
    trace.write_text(json.dumps({"t0": time.time(), "trace": "steady:rate=0.5"}))
    doc = _sim_sample(trace, peers)
    name = doc["metadata"]["name"]
    roles = doc["spec"]["roles"]
    want = {
        role: round(
            load_time_balancedness(r["parallelism"]["tensor"], r["eplb"]["redundantExperts"]), 3
        )
        for role, r in roles.items()
    }
    ns = env.new_namespace("eplb")
    _advertise_gpus(env, sum(r["gpusPerPod"] for r in roles.values()))
    try:
        env.apply(ns, doc)

        def shown() -> dict[str, Any] | None:
            st = (env.get("inferencedeployment", ns, name) or {}).get("status") or {}
            got = {r: (st.get("roles") or {}).get(r, {}).get("eplbBalancedness") for r in roles}
            return got if None not in got.values() else None

        got = poll("eplbBalancedness in status", shown, timeout_s=180, interval_s=1)
        assert got == want
        assert all(0.3 < v < 0.6 for v in want.values())  # the sample's skewed engines
    finally:
        env.kubectl("delete", "infd", "-n", ns, name, "--wait=false", check=False)
        env.delete_namespace(ns)
        _advertise_gpus(env, None)


@pytest.mark.parametrize(
    ("decode", "rule"),
    [
        ({"gpusPerPod": 2, "parallelism": {"tensor": 2, "expert": True},
          "eplb": {"enabled": True, "redundantExperts": 3}},
         "eplb.redundantExperts must be a multiple of the EP group"),
        ({"gpusPerPod": 2, "parallelism": {"tensor": 2}, "eplb": {"enabled": True}},
         "eplb needs parallelism.expert: true"),
    ],
)  # fmt: skip
def test_eplb_that_does_not_fit_the_ep_group_is_refused_at_admission(
    operator_env: OperatorEnv, decode: dict[str, Any], rule: str
) -> None:
    doc = {
        "apiVersion": "fleetserve.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "bad-eplb"},
        "spec": {
            "model": {"name": "m", "source": {"uri": "/m"}, "moe": True},
            "roles": {"prefill": {}, "decode": decode},
        },
    }
    out = operator_env.kubectl(
        "apply", "-n", "default", "-f", "-", stdin=yaml.safe_dump(doc), check=False
    )
    assert out.returncode != 0 and rule in out.stderr, out.stderr
    assert operator_env.get("inferencedeployment", "default", "bad-eplb") is None
