"""`fleetserve dev-cluster up|status|logs|down` as a user runs it: a second, small cluster started
by the CLI in a subprocess; `down` must leave no process, port or folder behind."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from kubernetes import client

from fleetserve.devcluster import kube
from fleetserve.devcluster.nodes import LOCAL_NODE_KEY
from fleetserve.devcluster.processes import is_port_open, process_start_time
from fleetserve.devcluster.testing import require_binaries

pytestmark = pytest.mark.k8s


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "fleetserve.devcluster", *args],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_cli_up_status_logs_down_leaves_nothing(tmp_path: Path) -> None:
    require_binaries()
    d = tmp_path / "cluster"
    up = cli("up", "--dir", str(d), "--gpu-nodes", "1", "--gpus-per-node", "2")
    assert up.returncode == 0, up.stderr
    kubeconfig = Path(up.stdout.strip())
    assert kubeconfig == d.resolve() / "admin.kubeconfig"
    try:
        status = cli("status", "--dir", str(d))
        assert status.returncode == 0, status.stdout
        assert "node gpu-node-0" in status.stdout and "STOPPED" not in status.stdout

        with kube.api_client(kubeconfig) as api:
            core = client.CoreV1Api(api)
            pod = {
                "metadata": {"name": "talker"},
                "spec": {
                    "nodeSelector": {LOCAL_NODE_KEY: "true"},
                    "tolerations": [{"key": LOCAL_NODE_KEY, "operator": "Exists"}],
                    "containers": [
                        {
                            "name": "main",
                            "image": "ignored",
                            "command": ["sh", "-c", "echo hello from $POD_IP; exec sleep 300"],
                        }
                    ],
                },
            }
            core.create_namespaced_pod("default", pod)
            deadline = time.monotonic() + 30
            while core.read_namespaced_pod("talker", "default").status.phase != "Running":
                assert time.monotonic() < deadline, "talker never ran"
                time.sleep(0.2)
            cid = (
                core.read_namespaced_pod("talker", "default")
                .status.container_statuses[0]
                .container_id
            )
        pod_pid = int(cid.removeprefix("local://"))
        deadline = time.monotonic() + 10
        while "hello from 127.0.0." not in (logs := cli("logs", "talker", "--dir", str(d))).stdout:
            assert time.monotonic() < deadline, logs
            time.sleep(0.2)

        state = json.loads((d / "state.json").read_text())
    finally:
        down = cli("down", "--dir", str(d))
    assert down.returncode == 0, down.stderr
    assert not d.exists()
    for p in [*state["processes"], {"pid": pod_pid, "name": "talker"}]:
        assert process_start_time(p["pid"]) is None, f"{p['name']} (pid {p['pid']}) still runs"
    assert not [port for port in state["ports"].values() if is_port_open(port)]
