from __future__ import annotations

import json
from pathlib import Path

import yaml

from fleetserve.api.compat import compatibility_hash
from fleetserve.api.models import InferenceDeploymentSpec
from fleetserve.operator.builders import Owner, build_children

ROOT = Path(__file__).resolve().parents[2]
OWNER = Owner(name="d", namespace="ns", uid="u-1")


def _sample(name: str) -> InferenceDeploymentSpec:
    doc = yaml.safe_load((ROOT / "manifests" / "samples" / name).read_text())
    return InferenceDeploymentSpec.model_validate(doc["spec"])


def _env(container: dict) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_dense_pd_children() -> None:
    spec = _sample("dense-pd.yaml")
    children = build_children(spec, OWNER)
    assert [(c["kind"], c["metadata"]["name"]) for c in children] == [
        ("ConfigMap", "d-engine"),
        ("Service", "d-prefill-0"),
        ("StatefulSet", "d-prefill-0"),
        ("Service", "d-prefill-1"),
        ("StatefulSet", "d-prefill-1"),
        ("Service", "d-decode-0"),
        ("StatefulSet", "d-decode-0"),
        ("Deployment", "d-router"),
        ("Service", "d"),
    ]
    for c in children:
        assert c["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    sts = children[6]
    assert sts["spec"]["replicas"] == 1
    pod = sts["spec"]["template"]
    assert pod["metadata"]["labels"]["fleetserve.io/compatibility-hash"] == compatibility_hash(spec)
    c = pod["spec"]["containers"][0]
    assert c["args"] == [
        "serve",
        "/model/llama-3-8b-instruct",
        "--served-model-name",
        "llama-3-8b",
        "--dtype",
        "bfloat16",
        "--block-size",
        "16",
        "--tensor-parallel-size",
        "4",
        "--pipeline-parallel-size",
        "1",
        "--host",
        "$(FLEETSERVE_POD_IP)",
        "--port",
        "8000",
        "--max-model-len",
        "8192",
        "--kv-transfer-config",
        '{"connector":"tcp","lease_seconds":30,"load_failure_policy":"recompute","protocol":"tcp","role":"consumer"}',
    ]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "4"
    env = _env(c)
    assert env["FLEETSERVE_WORLD_SIZE"] == "4" and env["FLEETSERVE_GROUP_SIZE"] == "1"
    assert env["FLEETSERVE_LEADER_ADDRESS"] == "d-decode-0-0.d-decode-0.ns.svc"
    assert {"name": "model", "mountPath": "/model", "readOnly": True} in c["volumeMounts"]
    assert children[1]["spec"]["clusterIP"] == "None"
    assert children[-1]["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": 8080}]


def test_multinode_decode_group_and_layout() -> None:
    spec = _sample("multinode-decode.yaml")
    children = build_children(spec, OWNER)
    sts = next(
        c for c in children if c["metadata"]["name"] == "d-decode-0" and c["kind"] == "StatefulSet"
    )
    assert sts["spec"]["replicas"] == 2
    env = _env(sts["spec"]["template"]["spec"]["containers"][0])
    assert env["FLEETSERVE_WORLD_SIZE"] == "16" and env["FLEETSERVE_GROUP_SIZE"] == "2"
    assert env["FLEETSERVE_RANK"] == {
        "fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}
    }
    config = json.loads(children[0]["data"]["engine.json"])["roles"]["decode"]
    assert config["ranks_per_pod"] == [list(range(8)), list(range(8, 16))]
    assert config["pipeline_groups"][0] == [0, 8]


def test_moe_eplb_flags_and_env() -> None:
    spec = _sample("moe-ep-eplb.yaml")
    sts = [c for c in build_children(spec, OWNER) if c["kind"] == "StatefulSet"]
    prefill = sts[0]["spec"]["template"]["spec"]["containers"][0]
    assert "--enable-expert-parallel" in prefill["args"] and "--enable-eplb" in prefill["args"]
    env = _env(prefill)
    assert env["FLEETSERVE_EP_SIZE"] == "4"
    assert env["FLEETSERVE_EPLB_POLICY"] == "hierarchical"
    assert env["FLEETSERVE_EPLB_REDUNDANT_EXPERTS"] == "4"


def test_cpu_sample_targets_local_node_without_gpus() -> None:
    spec = _sample("cpu-smollm2.yaml")
    sts = [c for c in build_children(spec, OWNER) if c["kind"] == "StatefulSet"]
    pod = sts[0]["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert "nvidia.com/gpu" not in c["resources"]["requests"]
    assert pod["nodeSelector"] == {"fleetserve.io/local-node": "true"}
    assert c["command"] == ["python", "-m", "fleetserve"]
    assert c["args"][-4:] == ["--device", "cpu", "--num-kv-blocks", "256"]
