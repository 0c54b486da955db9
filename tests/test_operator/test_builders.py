from __future__ import annotations

import argparse
import json
import logging
import math
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from fleetserve.api import labels
from fleetserve.api.compat import compatibility_hash, role_compatibility_hashes
from fleetserve.api.models import InferenceDeploymentSpec, KVTransfer
from fleetserve.api.router_config import RouterConfig
from fleetserve.envs import read_env
from fleetserve.operator.builders import (
    ROUTER_POD_RULES,
    Owner,
    build_children,
    build_router_config,
    build_router_deployment,
    build_router_role,
    build_router_role_binding,
    build_router_service_account,
)
from fleetserve.operator.render import ENGINE_FLAGS

ROOT = Path(__file__).resolve().parents[2]
OWNER = Owner(name="d", namespace="ns", uid="u-1")
SAMPLES = sorted(p.name for p in (ROOT / "manifests" / "samples").glob("*.yaml"))
ENV_NAMES = [
    "FLEETSERVE_POD_IP",
    "FLEETSERVE_RANK",
    "FLEETSERVE_WORLD_SIZE",
    "FLEETSERVE_GROUP_SIZE",
    "FLEETSERVE_LEADER_ADDRESS",
]
POD_INDEX = {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}


def _sample(name: str) -> InferenceDeploymentSpec:
    doc = yaml.safe_load((ROOT / "manifests" / "samples" / name).read_text())
    return InferenceDeploymentSpec.model_validate(doc["spec"])


def _spec(**overrides: Any) -> InferenceDeploymentSpec:
    body = {"model": {"name": "m", "source": {"uri": "/m"}}, "roles": {"prefill": {}, "decode": {}}}
    return InferenceDeploymentSpec.model_validate({**body, **overrides})


def _env(container: dict) -> dict[str, object]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def _engines(spec: InferenceDeploymentSpec) -> list[dict[str, Any]]:
    return [c for c in build_children(spec, OWNER) if c["kind"] == "StatefulSet"]


def _container(sts: dict[str, Any]) -> dict[str, Any]:
    container: dict[str, Any] = sts["spec"]["template"]["spec"]["containers"][0]
    return container


def test_dense_pd_children() -> None:
    spec = _sample("dense-pd.yaml")
    children = build_children(spec, OWNER)
    assert [(c["kind"], c["metadata"]["name"]) for c in children] == [
        ("Service", "d-prefill-0"),
        ("StatefulSet", "d-prefill-0"),
        ("Service", "d-prefill-1"),
        ("StatefulSet", "d-prefill-1"),
        ("Service", "d-decode-0"),
        ("StatefulSet", "d-decode-0"),
        ("ServiceAccount", "d-router"),
        ("Role", "d-router"),
        ("RoleBinding", "d-router"),
        ("Deployment", "d-router"),
        ("Service", "d"),
    ]
    for c in children:
        assert c["metadata"]["ownerReferences"][0]["uid"] == "u-1"
    sts = children[5]
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
        "--host",
        "$(FLEETSERVE_POD_IP)",
        "--port",
        "8000",
        "--max-model-len",
        "8192",
        "--tensor-parallel-size",
        "4",
        "--kv-transfer-config",
        '{"connector":"tcp","host":"$(FLEETSERVE_POD_IP)","lease_seconds":30,'
        '"load_failure_policy":"fail","num_threads":4,"protocol":"tcp","role":"consumer",'
        '"transfer_mode":"pull"}',
    ]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "4"
    assert [e["name"] for e in c["env"]] == ENV_NAMES
    env = _env(c)
    assert env["FLEETSERVE_WORLD_SIZE"] == "4"
    assert env["FLEETSERVE_RANK"] == POD_INDEX
    assert env["FLEETSERVE_LEADER_ADDRESS"] == "d-decode-0-0.d-decode-0.ns.svc"
    assert c["volumeMounts"] == [
        {"name": "model", "mountPath": "/model", "readOnly": True},
        {"name": "dshm", "mountPath": "/dev/shm"},
    ]
    assert pod["spec"]["volumes"] == [
        {"name": "model", "persistentVolumeClaim": {"claimName": "models", "readOnly": True}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "32Gi"}},
    ]
    assert c["securityContext"] == {"capabilities": {"add": ["IPC_LOCK"]}}
    prefill_args = _container(children[1])["args"]
    assert (
        json.loads(prefill_args[prefill_args.index("--kv-transfer-config") + 1])["role"]
        == "producer"
    )
    assert children[0]["spec"]["clusterIP"] == "None"
    assert children[-1]["spec"]["ports"] == [{"name": "http", "port": 80, "targetPort": 8080}]


def test_no_engine_config_map_or_dead_env() -> None:
    """Nothing reads an engine.json or the old FLEETSERVE_* variables, so nothing renders them."""
    for sample in SAMPLES:
        children = build_children(_sample(sample), OWNER)
        assert {c["kind"] for c in children} == {
            "Service",
            "StatefulSet",
            "Deployment",
            "ServiceAccount",
            "Role",
            "RoleBinding",
        }
        for sts in (c for c in children if c["kind"] == "StatefulSet"):
            c = _container(sts)
            assert [e["name"] for e in c["env"]] == ENV_NAMES, sample
            assert "engine-config" not in json.dumps(sts)
            assert "/etc/fleetserve" not in json.dumps(sts)


@pytest.mark.parametrize("sample", SAMPLES)
def test_rendered_env_is_what_the_engine_reads(
    sample: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Every rendered variable is declared in fleetserve.envs and parses there, without warnings."""
    c = _container(_engines(_sample(sample))[-1])
    resolved = {"status.podIP": "10.0.0.7", POD_INDEX["fieldRef"]["fieldPath"]: "1"}
    environ = {
        e["name"]: e["value"] if "value" in e else resolved[e["valueFrom"]["fieldRef"]["fieldPath"]]
        for e in c["env"]
    }
    with caplog.at_level(logging.WARNING, logger="fleetserve.envs"):
        env = read_env(environ)
    assert caplog.records == []
    assert env.pod_ip == "10.0.0.7" and env.rank == 1
    assert env.leader_address is not None and env.leader_address.endswith(".ns.svc")
    assert env.world_size is not None and env.world_size >= 1


def test_multinode_decode_group_and_layout() -> None:
    spec = _sample("multinode-decode.yaml")
    sts = next(s for s in _engines(spec) if s["metadata"]["name"] == "d-decode-0")
    assert sts["spec"]["replicas"] == 2
    c = _container(sts)
    env = _env(c)
    assert env["FLEETSERVE_WORLD_SIZE"] == "16"
    assert env["FLEETSERVE_GROUP_SIZE"] == "2"
    assert env["FLEETSERVE_RANK"] == POD_INDEX
    assert env["FLEETSERVE_LEADER_ADDRESS"] == "d-decode-0-0.d-decode-0.ns.svc"
    i = c["args"].index("--tensor-parallel-size")
    assert c["args"][i : i + 4] == ["--tensor-parallel-size", "8", "--pipeline-parallel-size", "2"]
    assert "--data-parallel-size" not in c["args"]


def test_data_parallel_counts_in_world_and_group_size() -> None:
    # Data-parallel ranks run in one pod behind one server (issue 16: `DPAsyncLLM`).
    spec = _spec(
        roles={"unified": {"gpusPerPod": 6, "parallelism": {"tensor": 2, "data": 3}}},
        kvTransfer={"connector": "none"},
    )
    (unified,) = _engines(spec)
    assert unified["spec"]["replicas"] == 1
    assert _env(_container(unified))["FLEETSERVE_WORLD_SIZE"] == "6"
    assert _env(_container(unified))["FLEETSERVE_GROUP_SIZE"] == "1"
    args = _container(unified)["args"]
    i = args.index("--tensor-parallel-size")
    assert args[i : i + 4] == ["--tensor-parallel-size", "2", "--data-parallel-size", "3"]


def test_moe_eplb_flags() -> None:
    spec = _sample("moe-ep-eplb.yaml")
    prefill, decode = (_container(s)["args"] for s in _engines(spec))
    i = prefill.index("--enable-expert-parallel")
    assert prefill[i:][:10] == [
        "--enable-expert-parallel",
        "--enable-eplb",
        "--num-redundant-experts",
        "4",
        "--eplb-window-size",
        "1000",
        "--eplb-step-interval",
        "3000",
        "--eplb-policy",
        "hierarchical",
    ]
    assert decode[decode.index("--eplb-policy") + 1] == "global"
    assert decode[decode.index("--num-redundant-experts") + 1] == "8"


def test_eplb_flags_only_with_eplb() -> None:
    args = _container(_engines(_sample("dense-pd.yaml"))[0])["args"]
    assert not [a for a in args if "eplb" in a or "expert" in a]


def test_kv_transfer_config_keys_are_the_api_field_names() -> None:
    args = _container(_engines(_sample("dense-pd.yaml"))[0])["args"]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    # rdma_resource is the pod's (a resource request), role and host the engine's place.
    assert set(kv) == set(KVTransfer.model_fields) - {"rdma_resource"} | {"role", "host"}
    # ...and every key is one the engine's config has.
    from dataclasses import fields

    from fleetserve.engine.config import KVTransferConfig

    assert set(kv) <= {f.name for f in fields(KVTransferConfig)}


def _maximal_specs() -> list[InferenceDeploymentSpec]:
    """Between them every flag: data parallel runs in a unified role only (issue 16)."""
    model = {"name": "m", "source": {"uri": "/m"}, "moe": True, "maxModelLen": 64}
    role = {
        "gpusPerPod": 4,
        "parallelism": {"tensor": 2, "pipeline": 2, "expert": True},
        "eplb": {"enabled": True, "useAsync": True},
    }
    unified = {"gpusPerPod": 4, "parallelism": {"data": 2, "tensor": 2, "expert": True}}
    model = {**model, "quantization": "int8"}
    return [
        _spec(model=model, roles={"prefill": role, "decode": role}),
        _spec(model=model, roles={"unified": unified}, kvTransfer={"connector": "none"}),
    ]


def test_engine_flags_lists_every_rendered_flag() -> None:
    """ENGINE_FLAGS is the renderer's whole flag surface (the engine's parser must accept it)."""
    maximal = set()
    lora = {"adapters": [{"name": "a", "uri": "/m/a"}], "maxCpuLoras": 2}
    with_lora = _spec(model={"name": "m", "source": {"uri": "/m"}, "lora": lora})
    for sts in (s for spec in [*_maximal_specs(), with_lora] for s in _engines(spec)):
        maximal |= {a for a in _container(sts)["args"] if a.startswith("--")}
    assert maximal == set(ENGINE_FLAGS)
    for sample in SAMPLES:
        spec = _sample(sample)
        user = {f"--{k}" for k in spec.engine.args}
        for sts in _engines(spec):
            rendered = {a for a in _container(sts)["args"] if a.startswith("--")}
            assert rendered - user <= set(ENGINE_FLAGS), sample


def test_router_pods_request_their_resources() -> None:
    """Without requests a router pod is BestEffort, the first evicted under node pressure: it
    requests CPU (not limited) and memory (limited at the request), as the engines do."""

    def resources(spec: InferenceDeploymentSpec) -> dict[str, Any]:
        router = build_router_deployment(spec, OWNER)
        found: dict[str, Any] = router["spec"]["template"]["spec"]["containers"][0]["resources"]
        return found

    assert resources(_spec()) == {
        "requests": {"cpu": "100m", "memory": "256Mi"},
        "limits": {"memory": "256Mi"},
    }
    assert resources(_spec(router={"cpu": "2", "memory": "1Gi"})) == {
        "requests": {"cpu": "2", "memory": "1Gi"},
        "limits": {"memory": "1Gi"},
    }


def test_cpu_sample_runs_a_prefill_and_a_decode_engine_on_the_local_node() -> None:
    spec = _sample("cpu-smollm2.yaml")
    children = build_children(spec, OWNER)
    engines = [c for c in children if c["kind"] == "StatefulSet"]
    assert [s["metadata"]["name"] for s in engines] == ["d-prefill-0", "d-decode-0"]
    router = next(c for c in children if c["kind"] == "Deployment")
    assert router["spec"]["replicas"] == 1
    assert router["spec"]["template"]["spec"]["nodeSelector"] == {
        "fleetserve.io/local-node": "true"
    }
    for sts, role in zip(engines, ("producer", "consumer"), strict=True):
        pod = sts["spec"]["template"]["spec"]
        c = pod["containers"][0]
        assert "nvidia.com/gpu" not in c["resources"]["requests"]
        assert pod["nodeSelector"] == {"fleetserve.io/local-node": "true"}
        assert pod["volumes"] == [
            {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "2Gi"}}
        ]
        assert c["command"] == ["python", "-m", "fleetserve"]
        kv = c["args"].index("--kv-transfer-config")
        assert c["args"][:kv] == [
            "serve",
            "/root/.cache/fleetserve/models/SmolLM2-135M-Instruct",
            "--served-model-name",
            "smollm2",
            "--dtype",
            "float32",
            "--block-size",
            "16",
            "--host",
            "$(FLEETSERVE_POD_IP)",
            "--port",
            "8000",
            "--max-model-len",
            "2048",
        ]
        assert json.loads(c["args"][kv + 1])["role"] == role
        assert c["args"][kv + 2 :] == ["--device", "cpu", "--num-kv-blocks", "256"]


def _router_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    RouterConfig.add_cli_args(parser)
    return parser


@pytest.mark.parametrize("sample", SAMPLES)
def test_router_args_are_its_config(sample: str) -> None:
    spec = _sample(sample)
    router = next(c for c in build_children(spec, OWNER) if c["kind"] == "Deployment")
    c = _container(router)
    assert c["env"] == [
        {"name": "FLEETSERVE_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    ]
    assert c["args"][0] == "router"
    parsed = RouterConfig.from_args(_router_parser().parse_args(c["args"][1:]))
    assert parsed == build_router_config(spec, OWNER)
    assert parsed.mode == spec.router.disaggregation.mode
    assert parsed.min_uncached_tokens == spec.router.disaggregation.min_uncached_tokens
    # Both revisions of a roll stay visible; the router pairs within one hash.
    assert parsed.compatibility_hash is None
    assert parsed.block_size == spec.model.block_size
    assert (parsed.namespace, parsed.engine_port, parsed.port) == ("ns", 8000, 8080)
    assert parsed.host == "$(FLEETSERVE_POD_IP)"
    assert (parsed.prefix_aware, parsed.load_aware) == (
        spec.router.prefix_aware,
        spec.router.load_aware,
    )
    selectors = {
        "prefill": parsed.prefill_selector,
        "decode": parsed.decode_selector,
        "unified": parsed.unified_selector,
    }
    present = {name for name, _ in spec.roles.items()}
    for role, selector in selectors.items():
        want = (
            f"fleetserve.io/deployment=d,fleetserve.io/role={role},apps.kubernetes.io/pod-index=0"
            if role in present
            else None
        )
        assert selector == want


def test_each_role_labels_its_pods_with_its_own_hash() -> None:
    spec = _sample("dense-pd.yaml")
    hashes = role_compatibility_hashes(spec)
    for sts in _engines(spec):
        labels = sts["spec"]["template"]["metadata"]["labels"]
        role = labels["fleetserve.io/role"]
        assert labels["fleetserve.io/compatibility-hash"] == hashes[role]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"model": {"name": "m", "source": {"uri": "s3://bucket/m"}}},
            "model.source.uri must be pvc://, hostpath:// or an absolute path, got 's3://bucket/m'",
        ),
        (
            {"roles": {"prefill": {"gpusPerPod": 0}, "decode": {"gpusPerPod": 1}}},
            "set model.dtype explicitly, or give the roles matching devices",
        ),
    ],
)
def test_unrealisable_specs_raise_value_error(overrides: dict, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        build_children(_spec(**overrides), OWNER)


@pytest.mark.parametrize("sample", SAMPLES)
def test_labels_and_annotations_are_the_api_constants(sample: str) -> None:
    """The operator writes only the keys of fleetserve.api.labels (what the router selects by)."""
    keys = {getattr(labels, n) for n in labels.__all__ if n.startswith(("LABEL_", "ANNOTATION_"))}
    spec = _sample(sample)
    for child in build_children(spec, OWNER):
        metas = [child["metadata"]]
        if child["kind"] in ("StatefulSet", "Deployment"):
            metas.append(child["spec"]["template"]["metadata"])
            assert set(child["spec"]["selector"]["matchLabels"]) <= keys
        for meta in metas:
            assert set(meta.get("labels", {})) | set(meta.get("annotations", {})) <= keys
        assert child["metadata"]["labels"][labels.LABEL_DEPLOYMENT] == "d"
    engine_pods = [
        c["spec"]["template"] for c in build_children(spec, OWNER) if c["kind"] == "StatefulSet"
    ]
    for pod in engine_pods:
        assert set(pod["metadata"]["labels"]) == {
            labels.LABEL_DEPLOYMENT,
            labels.LABEL_ROLE,
            labels.LABEL_GROUP,
            labels.LABEL_COMPAT,
        }


def _kv_config(sts: dict[str, Any]) -> dict[str, Any]:
    args = _container(sts)["args"]
    config: dict[str, Any] = json.loads(args[args.index("--kv-transfer-config") + 1])
    return config


def test_transfer_settings_reach_both_roles_and_the_engine_accepts_them() -> None:
    """Every `kvTransfer` field lands in both roles' connector config (the role aside), and the
    engine's own parser takes the rendered JSON once the pod IP is substituted."""
    from fleetserve.engine.config import KVTransferConfig

    spec = _spec(
        kvTransfer={
            "connector": "mooncake",
            "transferMode": "push",
            "leaseSeconds": 12,
            "loadFailurePolicy": "recompute",
            "numThreads": 2,
        }
    )
    prefill, decode = (_kv_config(s) for s in _engines(spec))
    assert prefill.pop("role") == "producer" and decode.pop("role") == "consumer"
    assert (
        prefill
        == decode
        == {
            "connector": "mooncake",
            "protocol": "tcp",
            "transfer_mode": "push",
            "lease_seconds": 12,
            "load_failure_policy": "recompute",
            "num_threads": 2,
            "host": "$(FLEETSERVE_POD_IP)",
        }
    )
    parsed = KVTransferConfig.from_dict({**decode, "role": "consumer", "host": "10.0.0.7"})
    assert (parsed.transfer_mode, parsed.num_threads, parsed.lease_seconds) == ("push", 2, 12)


def test_communication_env_is_the_same_on_every_peer() -> None:
    spec = _spec(kvTransfer={"connector": "mooncake", "numThreads": 3})
    prefill, decode = (_container(s)["env"] for s in _engines(spec))
    mc = [[e for e in env if e["name"].startswith("MC_")] for env in (prefill, decode)]
    assert (
        mc[0]
        == mc[1]
        == [
            {"name": "MC_TCP_BIND_ADDRESS", "value": "$(FLEETSERVE_POD_IP)"},
            {"name": "MC_WORKERS_PER_CTX", "value": "3"},
        ]
    )
    # The variable it expands is defined before it (Kubernetes expands only earlier ones).
    names = [e["name"] for e in prefill]
    assert names.index("FLEETSERVE_POD_IP") < names.index("MC_TCP_BIND_ADDRESS")
    tcp = _spec(kvTransfer={"connector": "tcp"})
    for sts in _engines(tcp):
        assert [e["name"] for e in _container(sts)["env"]] == ENV_NAMES


def test_rdma_requests_the_device_resource_and_needs_mooncake() -> None:
    spec = _spec(kvTransfer={"connector": "mooncake", "protocol": "rdma", "rdmaResource": "x/hca"})
    for sts in _engines(spec):
        res = _container(sts)["resources"]
        assert res["requests"]["x/hca"] == res["limits"]["x/hca"] == "1"
    for sts in _engines(_spec(kvTransfer={"connector": "mooncake"})):
        assert not any("hca" in k for k in _container(sts)["resources"]["limits"])
    with pytest.raises(ValueError, match="protocol rdma needs the mooncake connector"):
        _spec(kvTransfer={"connector": "tcp", "protocol": "rdma"})


def test_unified_pods_get_no_transfer_parts() -> None:
    spec = _spec(kvTransfer={"connector": "none"}, roles={"unified": {}})
    for sts in _engines(spec):
        c = _container(sts)
        assert "securityContext" not in c
        assert "dshm" not in json.dumps(sts)


def test_transfer_mode_is_in_the_compatibility_hash() -> None:
    pull = compatibility_hash(_spec(kvTransfer={"transferMode": "pull"}))
    push = compatibility_hash(_spec(kvTransfer={"transferMode": "push"}))
    assert pull != push


def test_the_router_may_read_and_watch_pods_and_nothing_more() -> None:
    role = build_router_role(OWNER)
    assert role["apiVersion"] == "rbac.authorization.k8s.io/v1" and role["kind"] == "Role"
    assert role["metadata"]["namespace"] == "ns" and role["metadata"]["name"] == "d-router"
    assert role["rules"] == [
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
    ]
    assert [dict(r) for r in ROUTER_POD_RULES] == role["rules"]
    # Changing the built Role must not change the constant it came from.
    role["rules"][0]["verbs"].append("delete")
    assert ROUTER_POD_RULES[0]["verbs"] == ["get", "list", "watch"]


def test_the_router_runs_as_its_own_service_account_bound_to_its_role() -> None:
    spec = _sample("dense-pd.yaml")
    account = build_router_service_account(OWNER)
    binding = build_router_role_binding(OWNER)
    role = build_router_role(OWNER)
    assert account == {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {
            "name": "d-router",
            "namespace": "ns",
            "labels": {"fleetserve.io/deployment": "d", "fleetserve.io/role": "router"},
            "ownerReferences": [OWNER.reference()],
        },
    }
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": account["metadata"]["name"], "namespace": "ns"}
    ]
    for child in (account, role, binding):
        assert child["metadata"]["ownerReferences"] == [OWNER.reference()]
    pod = build_router_deployment(spec, OWNER)["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]


def test_the_router_is_ready_when_its_health_answers() -> None:
    router = build_router_deployment(_sample("dense-pd.yaml"), OWNER)
    c = _container(router)
    assert c["readinessProbe"]["httpGet"] == {"path": "/health", "port": 8080}
    assert c["ports"] == [{"name": "http", "containerPort": 8080}]


def test_a_router_roll_starts_the_new_one_first_and_lets_the_old_one_finish() -> None:
    router = build_router_deployment(_sample("dense-pd.yaml"), OWNER)
    assert router["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxUnavailable": 0, "maxSurge": 1},
    }
    args = RouterConfig.from_args(_router_parser().parse_args(_container(router)["args"][1:]))
    assert args.shutdown_delay_s > 0, "a stopping router must stay serving while endpoints update"
    grace = router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > args.shutdown_delay_s + args.shutdown_grace_s
    # The streams in flight get as long as an engine group's drain (the role default).
    assert args.shutdown_grace_s == 600


def test_the_router_drain_timeout_is_the_wait_for_its_streams() -> None:
    router = build_router_deployment(_spec(router={"drainTimeoutSeconds": 90}), OWNER)
    args = RouterConfig.from_args(_router_parser().parse_args(_container(router)["args"][1:]))
    assert args.shutdown_grace_s == 90
    grace = router["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace == math.ceil(args.shutdown_delay_s + 90) + 5
    with pytest.raises(ValidationError, match=r"drainTimeoutSeconds|drain_timeout_seconds"):
        _spec(router={"drainTimeoutSeconds": -1})


def test_the_router_block_sets_the_router_flags_and_placement() -> None:
    spec = _spec(
        router={
            "replicas": 2,
            "disaggregation": {"mode": "selective", "minUncachedTokens": 32},
            "prefixAware": False,
            "loadAware": False,
            "nodeSelector": {"pool": "cpu"},
            "tolerations": [{"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}],
        }
    )
    router = build_router_deployment(spec, OWNER)
    assert router["spec"]["replicas"] == 2
    pod = router["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"pool": "cpu"}
    assert pod["tolerations"] == [
        {"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}
    ]
    args = _container(router)["args"]
    parsed = RouterConfig.from_args(_router_parser().parse_args(args[1:]))
    assert (parsed.mode, parsed.min_uncached_tokens) == ("selective", 32)
    assert (parsed.prefix_aware, parsed.load_aware) == (False, False)
    assert "--no-prefix-aware" in args and "--no-load-aware" in args
    # Without a placement the pod spec names none (the scheduler's choice).
    default = build_router_deployment(_spec(), OWNER)["spec"]["template"]["spec"]
    assert "nodeSelector" not in default and "tolerations" not in default
