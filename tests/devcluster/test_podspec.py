"""Unit tests of the pure pod translations used by the local node agent (no cluster)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetserve.devcluster.podspec import (
    Probe,
    build_env,
    expand_vars,
    field_ref_value,
    map_volumes,
    mount_table,
    parse_probe,
    pod_phase,
    restart_backoff_s,
    rewrite_paths,
    should_restart,
    volume_files,
)


def make_pod(**spec: object) -> dict:
    return {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u1", "labels": {"app": "engine"}},
        "spec": {"nodeName": "n", "serviceAccountName": "sa", "containers": [], **spec},
        "status": {"podIP": "127.0.0.10", "podIPs": [{"ip": "127.0.0.10"}], "hostIP": "127.0.0.1"},
    }


def no_lookup(namespace: str, name: str) -> None:
    return None


def test_expand_vars_replaces_known_keeps_unknown_and_unescapes() -> None:
    env = {"A": "1", "B.c": "2"}
    assert expand_vars("x$(A)y$(B.c)$(NOPE)$$(A)", env) == "x1y2$(NOPE)$(A)"


def test_field_refs() -> None:
    pod = make_pod()
    assert field_ref_value(pod, "status.podIP") == "127.0.0.10"
    assert field_ref_value(pod, "metadata.namespace") == "ns"
    assert field_ref_value(pod, "metadata.labels['app']") == "engine"
    assert field_ref_value(pod, "spec.serviceAccountName") == "sa"
    with pytest.raises(ValueError, match="unsupported fieldRef"):
        field_ref_value(pod, "spec.containers")


def test_build_env_order_refs_and_pod_ip() -> None:
    container = {
        "envFrom": [{"configMapRef": {"name": "cm"}, "prefix": "CM_"}],
        "env": [
            {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "URL", "value": "http://$(NAME):$(CM_PORT)"},
            {"name": "PASS", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
            {
                "name": "OPT",
                "valueFrom": {"secretKeyRef": {"name": "gone", "key": "k", "optional": True}},
            },
        ],
    }
    env = build_env(
        make_pod(), container, base={"PATH": "/bin"},
        configmap=lambda ns, n: {"PORT": "80"} if (ns, n) == ("ns", "cm") else None,
        secret=lambda ns, n: {"k": "v"} if n == "s" else None,
    )  # fmt: skip
    assert env == {
        "PATH": "/bin",
        "CM_PORT": "80",
        "NAME": "p",
        "URL": "http://p:80",
        "PASS": "v",
        "POD_IP": "127.0.0.10",
    }


def test_build_env_missing_required_configmap_raises() -> None:
    container = {"envFrom": [{"configMapRef": {"name": "cm"}}]}
    with pytest.raises(LookupError, match="ConfigMap ns/cm"):
        build_env(make_pod(), container, base={}, configmap=no_lookup, secret=no_lookup)


def test_volumes_and_path_rewriting(tmp_path: Path) -> None:
    pod = make_pod(
        volumes=[
            {"name": "models", "hostPath": {"path": "/data/models"}},
            {"name": "scratch", "emptyDir": {}},
            {"name": "cfg", "configMap": {"name": "c"}},
            {"name": "claim", "persistentVolumeClaim": {"claimName": "c"}},
        ]
    )
    volumes = map_volumes(pod, tmp_path)
    assert volumes == {
        "models": Path("/data/models"),
        "scratch": tmp_path / "volumes" / "scratch",
        "cfg": tmp_path / "volumes" / "cfg",
    }
    container = {
        "volumeMounts": [
            {"name": "models", "mountPath": "/models"},
            {"name": "scratch", "mountPath": "/models/cache"},
            {"name": "claim", "mountPath": "/etc/claim"},
        ]
    }
    table = mount_table(container, volumes)
    assert [m for m, _ in table] == ["/models/cache", "/models"]
    assert rewrite_paths("/models/llama", table) == "/data/models/llama"
    assert rewrite_paths("/models/cache/x", table) == f"{tmp_path}/volumes/scratch/x"
    assert rewrite_paths("--model=/models/x", table) == "--model=/data/models/x"
    assert rewrite_paths("/modelsX", table) == "/modelsX"
    assert rewrite_paths("/a/models/x", table) == "/a/models/x"
    assert rewrite_paths("cat /models/a > /models/cache/b; ls '/models'", table) == (
        f"cat /data/models/a > {tmp_path}/volumes/scratch/b; ls '/data/models'"
    )
    assert rewrite_paths("/etc/claim/a", table) == "/etc/claim/a"  # no local folder: unchanged


def test_parse_probe_defaults_and_named_port() -> None:
    container = {"name": "c", "ports": [{"name": "http", "containerPort": 8000}]}
    probe = parse_probe(
        {"httpGet": {"path": "/health", "port": "http"}, "periodSeconds": 1}, container
    )
    assert probe == Probe(kind="http", port=8000, path="/health", period_s=1.0)
    assert parse_probe(None, container) is None
    assert parse_probe({"tcpSocket": {"port": 9}}, container) == Probe(kind="tcp", port=9)
    with pytest.raises(ValueError, match="named port"):
        parse_probe({"httpGet": {"port": "nope"}}, container)
    with pytest.raises(ValueError, match="unsupported probe"):
        parse_probe({"grpc": {"port": 1}}, container)


@pytest.mark.parametrize(
    ("policy", "code", "restart"),
    [
        ("Always", 0, True),
        ("Always", 1, True),
        ("OnFailure", 0, False),
        ("OnFailure", 2, True),
        ("Never", 1, False),
    ],
)
def test_should_restart(policy: str, code: int, restart: bool) -> None:
    assert should_restart(policy, code) is restart


def test_restart_backoff_is_small_and_capped() -> None:
    assert [restart_backoff_s(n) for n in range(6)] == [0.5, 1.0, 2.0, 4.0, 5.0, 5.0]
    assert restart_backoff_s(1000) == 5.0


def test_pod_phase() -> None:
    assert pod_phase(["waiting"], [None], restarting=False) == "Pending"
    assert pod_phase(["running", "terminated"], [None, 0], restarting=False) == "Running"
    assert pod_phase(["waiting"], [1], restarting=True) == "Running"
    assert pod_phase(["terminated", "terminated"], [0, 0], restarting=False) == "Succeeded"
    assert pod_phase(["terminated", "terminated"], [0, 137], restarting=False) == "Failed"


def test_volume_files_items_and_optional() -> None:
    data = {"a.yaml": "x: 1", "b": "2"}

    def cm(namespace: str, name: str) -> dict[str, str] | None:
        return data if name == "cm" else None

    whole = {"name": "v", "configMap": {"name": "cm"}}
    assert volume_files(whole, "ns", configmap=cm, secret=no_lookup) == data
    picked = {
        "name": "v",
        "configMap": {"name": "cm", "items": [{"key": "b", "path": "sub/b.txt"}]},
    }
    assert volume_files(picked, "ns", configmap=cm, secret=no_lookup) == {"sub/b.txt": "2"}
    optional = {"name": "v", "secret": {"secretName": "s", "optional": True}}
    assert volume_files(optional, "ns", configmap=cm, secret=no_lookup) == {}
    with pytest.raises(LookupError, match="Secret ns/s"):
        volume_files(
            {"name": "v", "secret": {"secretName": "s"}}, "ns", configmap=cm, secret=no_lookup
        )
