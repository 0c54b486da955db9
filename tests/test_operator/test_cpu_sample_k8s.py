"""Engine contract on the dev cluster's local node (issue 6 acceptance 5, issue 14's operator part).

The CPU SmolLM2 sample's pods run as real `fleetserve serve` processes: every rendered flag and env
var must be accepted (the connector config included), the engines must load the model and pass
their /health readiness probes, and the InferenceDeployment must turn Ready from those probes
alone and the router's (test_router_k8s.py goes through the router). Here the test drives the
disaggregated protocol itself: a prompt prefilled on the prefill pod and decoded on the decode pod
gives the tokens the prefill pod gives when it decodes the prompt alone.
"""

from __future__ import annotations

import json
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleetserve.engine.models.bundled import bundled_model_path
from tests.devcluster.helpers import poll
from tests.test_operator.helpers import OperatorEnv

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
        pods = env.get("pod", ns, selector=f"fleetserve.io/deployment={name},fleetserve.io/group")
        assert sorted(p["metadata"]["name"] for p in pods["items"]) == [
            f"{name}-decode-0-0",
            f"{name}-prefill-0-0",
        ]
        st = env.get("inferencedeployment", ns, name)["status"]
        assert st["phase"] == "Ready"
        assert (
            st["roles"]["prefill"]["readyReplicas"] == st["roles"]["decode"]["readyReplicas"] == 1
        )
        assert st["router"] == {"replicas": 1, "readyReplicas": 1}
        conditions = {c["type"]: c["status"] for c in st["conditions"]}
        assert conditions["TransferReady"] == "True"
        ip = {}
        for pod in pods["items"]:
            assert pod["spec"]["nodeName"] == env.dc.local_node
            statuses = pod["status"]["containerStatuses"]
            assert [s["restartCount"] for s in statuses] == [0], pod["metadata"]["name"]
            assert [s["ready"] for s in statuses] == [True], pod["metadata"]["name"]
            ip[pod["metadata"]["labels"]["fleetserve.io/role"]] = pod["status"]["podIP"]
            models = f"http://{pod['status']['podIP']}:8000/v1/models"
            with urllib.request.urlopen(models, timeout=10) as resp:
                assert [m["id"] for m in json.load(resp)["data"]] == ["smollm2"]
        prefill, decode = f"http://{ip['prefill']}:8000", f"http://{ip['decode']}:8000"
        with urllib.request.urlopen(f"{prefill}/kv_transfer", timeout=10) as resp:
            identity = json.load(resp)
        # The connector listens at the pod's IP, as rendered from $(FLEETSERVE_POD_IP).
        assert identity["role"] == "producer" and identity["host"] == ip["prefill"]
        prompt = "The three primary colours are red, yellow and"
        alone = _complete(prefill, prompt)
        first = _complete(prefill, prompt, kv_transfer_params={"do_remote_decode": True})
        params = first["kv_transfer_params"]
        assert params["remote_host"] == ip["prefill"] and params["remote_block_ids"]
        second = _complete(decode, prompt, kv_transfer_params=params)
        assert second["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
        usage = second["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    finally:
        env.kubectl("delete", "infd", "-n", ns, name, "--wait=false", check=False)
        env.delete_namespace(ns)


def _complete(base: str, prompt: str, **body: Any) -> dict[str, Any]:
    data = json.dumps(
        {
            "model": "smollm2",
            "prompt": prompt,
            "max_tokens": 8,
            "temperature": 0.0,
            "return_token_ids": True,
            **body,
        }
    ).encode()
    request = urllib.request.Request(
        f"{base}/v1/completions", data=data, headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=60) as resp:
        result: dict[str, Any] = json.load(resp)
    return result
