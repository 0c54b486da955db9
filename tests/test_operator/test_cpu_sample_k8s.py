"""Engine contract on the dev cluster's local node (issue 6 acceptance 5).

The CPU SmolLM2 sample's pods run as real `fleetserve serve` processes: every rendered flag and env
var must be accepted, the engines must load the model and pass their /health readiness probes, and
the InferenceDeployment must turn Ready from those probes alone. The sample is two unified engines
and no router (KV transfer and the router are later issues; the sample's comment says why), so
nothing on a kwok node contributes to its readiness.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path

import pytest
import yaml

from fleetserve.engine.models.bundled import bundled_model_path
from tests.test_operator.conftest import OperatorEnv, poll

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_cpu_sample_runs_real_engines(operator_env: OperatorEnv) -> None:
    env = operator_env
    doc = yaml.safe_load((ROOT / "manifests" / "samples" / "cpu-smollm2.yaml").read_text())
    # The sample names the default cache folder; this machine's may differ (HOME, CI's fresh
    # model cache), so point it at the prepared folder (converting it first if needed).
    doc["spec"]["model"]["source"]["uri"] = str(bundled_model_path())
    # The local node runs `command` as a process: use this interpreter (the image is ignored).
    doc["spec"]["engine"]["command"] = [sys.executable, "-m", "fleetserve"]
    name = doc["metadata"]["name"]
    ns = env.new_namespace("cpu-sample")
    try:
        env.apply(ns, doc)

        def ready() -> bool:
            st = (env.get("inferencedeployment", ns, name) or {}).get("status") or {}
            return any(
                c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions", [])
            )

        poll("Ready from the engines' readiness probes", ready, timeout_s=240, interval_s=1)
        pods = env.get("pod", ns, selector=f"fleetserve.io/deployment={name}")
        assert sorted(p["metadata"]["name"] for p in pods["items"]) == [
            f"{name}-unified-0-0",
            f"{name}-unified-1-0",
        ]
        st = env.get("inferencedeployment", ns, name)["status"]
        assert st["phase"] == "Ready"
        assert st["roles"]["unified"]["readyReplicas"] == 2
        assert st["router"] == {"replicas": 0, "readyReplicas": 0}
        for pod in pods["items"]:
            assert pod["spec"]["nodeName"] == env.dc.local_node
            statuses = pod["status"]["containerStatuses"]
            assert [s["restartCount"] for s in statuses] == [0], pod["metadata"]["name"]
            assert [s["ready"] for s in statuses] == [True], pod["metadata"]["name"]
            assert "--kv-transfer-config" not in pod["spec"]["containers"][0]["args"]
            url = f"http://{pod['status']['podIP']}:8000/health"
            with urllib.request.urlopen(url, timeout=10) as resp:
                assert resp.status == 200
            models = f"http://{pod['status']['podIP']}:8000/v1/models"
            with urllib.request.urlopen(models, timeout=10) as resp:
                assert [m["id"] for m in json.load(resp)["data"]] == ["smollm2"]
    finally:
        env.kubectl("delete", "infd", "-n", ns, name, "--wait=false", check=False)
        env.delete_namespace(ns)
