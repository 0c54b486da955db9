"""The local node's container runtime with real local processes but no cluster (a few seconds)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from fleetserve.common.ports import free_port
from fleetserve.devcluster.pod_launch import ContainerLaunch, PodLaunch, build_launch
from fleetserve.devcluster.pod_runtime import PodRuntime
from fleetserve.devcluster.podspec import Probe


def tick_until(runtime: PodRuntime, predicate, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"timed out; status: {runtime.status()}"
        runtime.tick(time.monotonic())
        time.sleep(0.05)


def launch(tmp_path: Path, code: str, **kw: object) -> ContainerLaunch:
    return ContainerLaunch(
        name="c", argv=(sys.executable, "-c", code), env={"PATH": "/usr/bin:/bin"}, cwd=tmp_path,
        log=tmp_path / "c.log", pod_ip="127.0.0.1", **kw,
    )  # fmt: skip


def test_on_failure_restarts_then_succeeds(tmp_path: Path) -> None:
    # Fails on the first run, succeeds on the second: OnFailure restarts exactly once.
    marker = tmp_path / "ran"
    code = f"import pathlib,sys; p=pathlib.Path({str(marker)!r}); first=not p.exists(); p.touch(); sys.exit(3 if first else 0)"
    runtime = PodRuntime(
        "u", "127.0.0.1", PodLaunch(init=(), containers=(launch(tmp_path, code),)), "OnFailure"
    )
    tick_until(runtime, lambda: runtime.status()["phase"] == "Succeeded")
    status = runtime.status()["containerStatuses"][0]
    assert status["restartCount"] == 1
    assert status["lastState"]["terminated"]["exitCode"] == 3
    assert status["state"]["terminated"]["reason"] == "Completed"
    assert (tmp_path / "c.log").read_text().count("start #") == 2


def test_http_readiness_and_termination(tmp_path: Path) -> None:
    port = free_port()
    code = f"import http.server as h; h.ThreadingHTTPServer(('127.0.0.1', {port}), h.SimpleHTTPRequestHandler).serve_forever()"
    probe = Probe(kind="http", port=port, path="/", period_s=0.2)
    runtime = PodRuntime(
        "u",
        "127.0.0.1",
        PodLaunch(init=(), containers=(launch(tmp_path, code, readiness=probe),)),
        "Always",
    )
    runtime.tick(time.monotonic())
    assert runtime.status()["containerStatuses"][0]["ready"] is False
    tick_until(runtime, lambda: runtime.status()["containerStatuses"][0]["ready"])
    conditions = {c["type"]: c["status"] for c in runtime.status()["conditions"]}
    assert conditions["Ready"] == "True" and runtime.status()["phase"] == "Running"
    runtime.terminate(grace_s=2.0)
    tick_until(runtime, lambda: runtime.is_stopped)
    assert runtime.records() == [] or all(not r.is_alive() for r in runtime.records())


def test_build_launches_expands_and_maps(tmp_path: Path) -> None:
    pod = {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u"},
        "spec": {
            "volumes": [
                {"name": "scratch", "emptyDir": {}},
                {"name": "cfg", "configMap": {"name": "engine"}},
            ],
            "containers": [
                {
                    "name": "c", "image": "ignored", "command": ["serve"],
                    "args": ["--host=$(POD_IP)", "--cache=/cache/x", "--config", "/etc/engine/engine.yaml"], "workingDir": "/cache",
                    "volumeMounts": [
                        {"name": "scratch", "mountPath": "/cache"},
                        {"name": "cfg", "mountPath": "/etc/engine", "readOnly": True},
                    ],
                    "env": [{"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}],
                }
            ],
        },
        "status": {"podIP": "127.0.0.11"},
    }  # fmt: skip
    launch_ = build_launch(
        pod, pod_dir=tmp_path, logs_dir=tmp_path / "logs", base_env={},
        configmap=lambda ns, name: {"engine.yaml": "tp: 1"} if name == "engine" else None,
        secret=lambda *_: None,
    )  # fmt: skip
    assert launch_.init == ()
    (only,) = launch_.containers
    scratch = tmp_path / "volumes" / "scratch"
    config = tmp_path / "volumes" / "cfg" / "engine.yaml"
    assert only.argv == (
        "serve",
        "--host=127.0.0.11",
        f"--cache={scratch}/x",
        "--config",
        str(config),
    )
    assert config.read_text() == "tp: 1"
    assert only.cwd == scratch and scratch.is_dir()
    assert only.env["IP"] == only.env["POD_IP"] == "127.0.0.11"
    assert only.log == tmp_path / "logs" / "ns_p_c.log"


def test_liveness_failure_restarts(tmp_path: Path) -> None:
    # Nothing listens on the probed port, so the liveness probe kills the process.
    probe = Probe(kind="tcp", port=free_port(), period_s=0.1, failure_threshold=2)
    code = "import time; time.sleep(60)"
    runtime = PodRuntime(
        "u",
        "127.0.0.1",
        PodLaunch(init=(), containers=(launch(tmp_path, code, liveness=probe),)),
        "Always",
    )
    tick_until(runtime, lambda: runtime.status()["containerStatuses"][0]["restartCount"] >= 1)
    last = runtime.status()["containerStatuses"][0]["lastState"]["terminated"]
    assert last["exitCode"] == 137
    runtime.terminate(grace_s=0.5)
    tick_until(runtime, lambda: runtime.is_stopped)


def test_init_containers_run_in_order_before_containers(tmp_path: Path) -> None:
    out = tmp_path / "order"
    step = f"import sys; open({str(out)!r}, 'a').write(sys.argv[1] + ' ')"
    init = tuple(
        ContainerLaunch(
            name=f"init{i}", argv=(sys.executable, "-c", step, f"init{i}"), env={}, cwd=tmp_path,
            log=tmp_path / f"init{i}.log", pod_ip="127.0.0.1",
        )
        for i in range(2)
    )  # fmt: skip
    main = launch(tmp_path, step.replace("sys.argv[1]", "'main'"))
    runtime = PodRuntime("u", "127.0.0.1", PodLaunch(init=init, containers=(main,)), "OnFailure")
    assert runtime.status()["phase"] == "Pending"
    tick_until(runtime, lambda: runtime.status()["phase"] == "Succeeded")
    assert out.read_text() == "init0 init1 main "
    status = runtime.status()
    assert [c["state"]["terminated"]["exitCode"] for c in status["initContainerStatuses"]] == [0, 0]
    assert {c["type"]: c["status"] for c in status["conditions"]}["Initialized"] == "True"


def test_failing_init_container_with_never_fails_the_pod(tmp_path: Path) -> None:
    init = (launch(tmp_path, "raise SystemExit(2)"),)
    main = launch(tmp_path, "print('never runs')")
    runtime = PodRuntime("u", "127.0.0.1", PodLaunch(init=init, containers=(main,)), "Never")
    tick_until(runtime, lambda: runtime.status()["phase"] == "Failed")
    assert runtime.status()["containerStatuses"][0]["state"] == {
        "waiting": {"reason": "PodInitializing"}
    }


def test_exec_readiness_probe(tmp_path: Path) -> None:
    marker = tmp_path / "ready"
    probe = Probe(kind="exec", command=("test", "-f", str(marker)), period_s=0.1)
    code = "import time; time.sleep(60)"
    runtime = PodRuntime(
        "u",
        "127.0.0.1",
        PodLaunch(init=(), containers=(launch(tmp_path, code, readiness=probe),)),
        "Always",
    )
    runtime.tick(time.monotonic())
    time.sleep(0.3)
    assert runtime.status()["containerStatuses"][0]["ready"] is False
    marker.touch()
    tick_until(runtime, lambda: runtime.status()["containerStatuses"][0]["ready"])
    runtime.terminate(grace_s=0.5)
    tick_until(runtime, lambda: runtime.is_stopped)
