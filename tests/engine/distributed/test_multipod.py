"""Issue 16 acceptance 4 (a): two "pods" of one TP=2 replica group, as two process trees on
loopback, each started with the command line and env the operator renders for its pod.

The pods' container comes from the operator's own `build_group_statefulset` (a unified role,
tensor 2, gpusPerPod 1: a group of two pods, one rank each, run on the CPU); the env's field
references (pod IP, pod index) are resolved by the dev cluster's own `build_env`, as its local
node does, and so is the leader's DNS record: to the leader pod's IP, as cluster DNS would (there
is no DNS on loopback; the local node resolves pod records the same way). The group serves a completion whose greedy tokens equal
TP=1's; when the leader goes away the follower pod exits, visibly and within its bound; when the
follower pod goes away the leader's /health fails within seconds.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import requests

from fleetserve.api.labels import LABEL_POD_INDEX
from fleetserve.api.models import InferenceDeploymentSpec
from fleetserve.devcluster.podspec import build_env, expand_vars
from fleetserve.engine.distributed.follower import LEADER_LOST_S
from fleetserve.envs import PREFIX
from fleetserve.operator.builders import Owner, build_group_statefulset
from fleetserve.operator.render import ENGINE_PORT

pytestmark = [pytest.mark.slow]
# NOTE: the pods bind fixed ports (8000, 29500, as the operator renders them), as the dev
# cluster's local pods do: under `pytest -n` this module runs on the k8s tests' worker, never
# beside them (`SHARED_PORT_MODULES` in tests/conftest.py).

OWNER = Owner(name="tiny", namespace="ns", uid="u-1")
POD_IPS = ("127.0.86.1", "127.0.86.2")
"""The two pods' addresses (loopback, as on the dev cluster's local node)."""
PROMPT = [1, 17, 99, 42, 250, 7, 300, 11, 64, 5]
MAX_TOKENS = 12


def group_spec(
    model_dir: Path, parallelism: dict[str, int] | None = None
) -> InferenceDeploymentSpec:
    """A unified role of one rank per pod (gpusPerPod 1, the engines on the CPU); TP=2 unless
    `parallelism` says otherwise."""
    return InferenceDeploymentSpec.model_validate(
        {
            "model": {
                "name": "tiny",
                "source": {"uri": str(model_dir)},
                "dtype": "float32",
                "maxModelLen": 256,
            },
            "engine": {
                "command": [sys.executable, "-m", "fleetserve"],
                "args": {"device": "cpu", "num-kv-blocks": "64"},
                # The pods' start-up runs the layered self-test across the group first.
                "env": {"FLEETSERVE_COMM_CHECK": "1"},
            },
            "kvTransfer": {"connector": "none"},
            "roles": {"unified": {"gpusPerPod": 1, "parallelism": parallelism or {"tensor": 2}}},
        }
    )


def pod_commands(spec: InferenceDeploymentSpec) -> list[tuple[list[str], dict[str, str]]]:
    """(argv, env) of each pod of group 0, from the operator's StatefulSet."""
    role = spec.roles.unified
    assert role is not None and role.group_size == 2
    sts = build_group_statefulset(spec, OWNER, "unified", role, 0)
    assert sts["spec"]["replicas"] == 2
    container = sts["spec"]["template"]["spec"]["containers"][0]
    leader_dns = f"{sts['metadata']['name']}-0.{sts['metadata']['name']}.{OWNER.namespace}.svc"
    base = {k: v for k, v in os.environ.items() if not k.startswith(PREFIX)}
    commands = []
    for index, ip in enumerate(POD_IPS):
        pod = {
            "metadata": {
                "name": f"{sts['metadata']['name']}-{index}",
                "namespace": OWNER.namespace,
                "labels": {
                    **sts["spec"]["template"]["metadata"]["labels"],
                    LABEL_POD_INDEX: str(index),
                },
            },
            "status": {"podIP": ip},
        }
        assert _env_value(container, f"{PREFIX}LEADER_ADDRESS") == leader_dns
        # The leader's DNS record resolves to its IP, as on the local node (`pod_ip`).
        env = build_env(
            pod, container, base=base, configmap=_none, secret=_none, pod_ip=_pod_ips(sts)
        )
        assert env[f"{PREFIX}LEADER_ADDRESS"] == POD_IPS[0]
        argv = [expand_vars(a, env) for a in container["command"] + container["args"]]
        commands.append((argv, env))
    return commands


def _none(namespace: str, name: str) -> None:
    return None


def _env_value(container: dict[str, Any], name: str) -> str:
    return str(next(e["value"] for e in container["env"] if e["name"] == name))


def _pod_ips(sts: dict[str, Any]) -> Any:
    """The DNS records of the group's pods (`<sts>-<i>.<sts>.ns.svc`) → their loopback IPs."""
    name = sts["metadata"]["name"]

    def lookup(namespace: str, hostname: str, subdomain: str) -> str | None:
        pods = {f"{name}-{i}": ip for i, ip in enumerate(POD_IPS)}
        ok = (namespace, subdomain) == (OWNER.namespace, name)
        return pods.get(hostname) if ok else None

    return lookup


@dataclass
class Pod:
    process: subprocess.Popen[bytes]
    log: Path
    url: str

    def text(self) -> str:
        return self.log.read_text(errors="replace")


@pytest.fixture(params=[{"tensor": 2}], ids=["tp2"])
def group(
    request: pytest.FixtureRequest, tiny_llama_dir: Path, tmp_path: Path
) -> Iterator[list[Pod]]:
    pods: list[Pod] = []
    spec = group_spec(tiny_llama_dir, request.param)
    try:
        for index, (argv, env) in enumerate(pod_commands(spec)):
            log = tmp_path / f"pod-{index}.log"
            with log.open("wb") as out:
                proc = subprocess.Popen(
                    argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
                )
            pods.append(Pod(proc, log, f"http://{POD_IPS[index]}:{ENGINE_PORT}"))
        for pod in pods:
            _wait_healthy(pod, timeout_s=300)
        yield pods
    finally:
        for pod in pods:
            if pod.process.poll() is None:
                os.killpg(pod.process.pid, signal.SIGKILL)
            pod.process.wait(timeout=30)


def _wait_healthy(pod: Pod, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert pod.process.poll() is None, f"pod exited:\n{pod.text()[-4000:]}"
        assert time.monotonic() < deadline, f"not healthy in {timeout_s} s:\n{pod.text()[-4000:]}"
        try:
            if requests.get(f"{pod.url}/health", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.5)


def _tp1_tokens(model_dir: Path) -> list[int]:
    from fleetserve import LLM, SamplingParams

    llm = LLM(str(model_dir), dtype="float32", device="cpu", num_kv_blocks=64, max_model_len=256)
    out = llm.generate(
        [{"prompt_token_ids": PROMPT}], SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    )
    return list(out[0].outputs[0].token_ids)


def _complete(pod: Pod) -> dict[str, Any]:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "return_token_ids": True, "ignore_eos": True}  # fmt: skip
    response = requests.post(f"{pod.url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    result: dict[str, Any] = response.json()
    return result


@pytest.mark.timeout(600)
def test_two_pods_serve_tp1_tokens_and_the_follower_leaves_with_its_leader(
    group: list[Pod], tiny_llama_dir: Path
) -> None:
    leader, follower = group
    assert "communication self-test of ranks [0] passed" in leader.text()
    assert "communication self-test of ranks [1] passed" in follower.text()
    assert "pod 1 of 2: ranks [1] joining the leader at tcp://127.0.86.1:29500" in follower.text()
    # Only the leader serves: the follower's address answers /health and nothing else.
    assert requests.get(f"{follower.url}/v1/models", timeout=5).status_code == 404
    got = _complete(leader)["choices"][0]["token_ids"]
    assert len(got) == MAX_TOKENS
    assert got == _tp1_tokens(tiny_llama_dir)

    killed = time.monotonic()
    os.killpg(leader.process.pid, signal.SIGKILL)
    code = follower.process.wait(timeout=LEADER_LOST_S + 20)
    assert code == 1
    assert time.monotonic() - killed < LEADER_LOST_S + 10
    assert "the leader at tcp://127.0.86.1:29501 is gone" in follower.text()


@pytest.mark.timeout(600)
def test_a_lost_follower_pod_fails_the_leaders_health(group: list[Pod]) -> None:
    leader, follower = group
    assert len(_complete(leader)["choices"][0]["token_ids"]) == MAX_TOKENS
    killed = time.monotonic()
    os.killpg(follower.process.pid, signal.SIGKILL)
    while requests.get(f"{leader.url}/health", timeout=5).status_code == 200:
        assert time.monotonic() - killed < 10.0, "/health still passes 10 s after the pod died"
        time.sleep(0.2)
    assert "worker rank 1 on pod 1 of the group disconnected" in leader.text()
    response = requests.post(
        f"{leader.url}/v1/completions",
        json={"model": "tiny", "prompt": PROMPT, "max_tokens": 4},
        timeout=30,
    )
    assert response.status_code == 503, response.text


@pytest.mark.timeout(600)
@pytest.mark.parametrize("group", [{"pipeline": 2}], indirect=True, ids=["pp2"])
def test_a_pipeline_split_across_two_pods_serves_tp1_tokens(
    group: list[Pod], tiny_llama_dir: Path
) -> None:
    # The driver (TP rank 0 of the last stage) is rank 1, on the follower pod: its sampled
    # tokens come back to the leader over the group's control sockets.
    leader, _ = group
    assert _complete(leader)["choices"][0]["token_ids"] == _tp1_tokens(tiny_llama_dir)


@pytest.mark.timeout(600)
def test_a_dead_worker_on_the_follower_ends_its_pod_and_fails_the_leader(
    group: list[Pod],
) -> None:
    leader, follower = group
    ps = subprocess.run(
        # NOTE: -ww: without it ps cuts `args` at $COLUMNS, and a long checkout path (CI's
        # clean clone) pushed "worker_proc" past the cut.
        ["ps", "-ww", "--ppid", str(follower.process.pid), "-o", "pid=,args="],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    (worker,) = [int(line.split()[0]) for line in ps.stdout.splitlines() if "worker_proc" in line]
    killed = time.monotonic()
    os.kill(worker, signal.SIGKILL)
    assert follower.process.wait(timeout=10) == 1
    assert "worker rank 1 exited with -9; this pod leaves the group" in follower.text()
    while requests.get(f"{leader.url}/health", timeout=5).status_code == 200:
        assert time.monotonic() - killed < 10.0, "/health still passes 10 s after the kill"
        time.sleep(0.2)
    assert "worker rank 1 on pod 1 of the group disconnected" in leader.text()
