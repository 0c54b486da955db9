"""Issue 16 acceptance 4 (b): on the dev cluster's local node, a two-pod CPU replica group from an
InferenceDeployment serves a request.

A unified role with tensor 2 and gpusPerPod 1 is a group of two pods, one rank each; the local
node advertises two (fake) GPUs for the test and the engines run on the CPU (`device: cpu`).
The operator renders the group's env; pod 0 serves, pod 1 runs its worker and joins pod 0's
process group at the leader's DNS record (which the local node resolves to pod 0's IP, standing
in for cluster DNS), after both pods' start-up ran the communication self-test across the
group (FLEETSERVE_COMM_CHECK). The group turns Ready from both pods' probes, and a completion through the
leader and through the router gives TP=1's greedy tokens.
"""

from __future__ import annotations

import json
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from fleetserve.api.labels import LABEL_POD_INDEX
from fleetserve.devcluster.pod_launch import log_path
from tests.devcluster.helpers import poll
from tests.engine.tiny_models import make_tiny_model
from tests.test_operator.helpers import OperatorEnv

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

SEL = "fleetserve.io/deployment"
GPU = "nvidia.com/gpu"
PROMPT = [1, 17, 99, 42, 250, 7, 300, 11, 64, 5]
MAX_TOKENS = 12
LOCAL = {
    "nodeSelector": {"fleetserve.io/local-node": "true"},
    "tolerations": [
        {"key": "fleetserve.io/local-node", "operator": "Exists", "effect": "NoSchedule"}
    ],
}


def _doc(model_dir: Path) -> dict[str, Any]:
    return {
        "apiVersion": "fleetserve.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": "pods2"},
        "spec": {
            "model": {
                "name": "tiny",
                "source": {"uri": str(model_dir)},
                "dtype": "float32",
                "maxModelLen": 256,
            },
            "engine": {
                "command": [sys.executable, "-m", "fleetserve"],
                "cpu": "300m",
                "memory": "2Gi",
                "args": {"device": "cpu", "num-kv-blocks": "64"},
                # Each pod runs the layered self-test across the group before it serves.
                "env": {"FLEETSERVE_COMM_CHECK": "1"},
            },
            "kvTransfer": {"connector": "none"},
            "roles": {
                "unified": {"replicas": 1, "gpusPerPod": 1, "parallelism": {"tensor": 2}, **LOCAL}
            },
            "router": {"replicas": 1, **LOCAL},
        },
    }


def _advertise_gpus(env: OperatorEnv, count: int | None) -> None:
    value = None if count is None else str(count)
    patch = {"status": {"capacity": {GPU: value}, "allocatable": {GPU: value}}}
    env.kubectl(
        "patch", "node", env.dc.local_node, "--subresource=status", "--type=merge",
        "-p", json.dumps(patch),
    )  # fmt: skip


def _complete(base: str) -> list[int]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    request = urllib.request.Request(
        f"{base}/v1/completions", data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=120) as resp:
        return list(json.load(resp)["choices"][0]["token_ids"])


def _status_code(url: str) -> int:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code


def _tp1_tokens(model_dir: Path) -> list[int]:
    from fleetserve import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=256)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return list(llm.generate([{"prompt_token_ids": PROMPT}], params)[0].outputs[0].token_ids)


@pytest.mark.timeout(900)
def test_a_two_pod_cpu_group_serves_tp1_tokens(
    operator_env: OperatorEnv, tmp_path_factory: pytest.TempPathFactory
) -> None:
    env = operator_env
    model_dir = make_tiny_model(tmp_path_factory.mktemp("models"), "llama")
    doc = _doc(model_dir)
    name = doc["metadata"]["name"]
    ns = env.new_namespace("multipod")
    _advertise_gpus(env, 2)
    try:
        env.apply(ns, doc)

        def ready() -> bool:
            st = (env.get("inferencedeployment", ns, name) or {}).get("status") or {}
            return any(
                c["type"] == "Ready" and c["status"] == "True" for c in st.get("conditions", [])
            )

        poll("Ready from both pods' probes", ready, timeout_s=300, interval_s=1)
        st = env.get("inferencedeployment", ns, name)["status"]
        assert st["roles"]["unified"]["groupSize"] == 2
        assert st["roles"]["unified"]["readyReplicas"] == 1
        pods = env.get("pod", ns, selector=f"{SEL}={name},fleetserve.io/role=unified")["items"]
        by_index = {p["metadata"]["labels"][LABEL_POD_INDEX]: p for p in pods}
        assert sorted(by_index) == ["0", "1"]
        for index, pod in by_index.items():
            assert pod["spec"]["nodeName"] == env.dc.local_node
            assert [s["restartCount"] for s in pod["status"]["containerStatuses"]] == [0]
            log = log_path(env.dc.state.logs_dir / "pods", ns, pod["metadata"]["name"], "engine")
            assert f"communication self-test of ranks [{index}] passed" in log.read_text()
        leader = f"http://{by_index['0']['status']['podIP']}:8000"
        follower = f"http://{by_index['1']['status']['podIP']}:8000"
        # The follower runs its rank only: healthy, and no API.
        assert _status_code(f"{follower}/health") == 200
        assert _status_code(f"{follower}/v1/models") == 404
        want = _tp1_tokens(model_dir)
        assert _complete(leader) == want
        router = env.get("pod", ns, selector=f"{SEL}={name},fleetserve.io/role=router")["items"]
        assert len(router) == 1
        assert _complete(f"http://{router[0]['status']['podIP']}:8080") == want
    finally:
        env.kubectl("delete", "infd", "-n", ns, name, "--wait=false", check=False)
        env.delete_namespace(ns)
        _advertise_gpus(env, None)
