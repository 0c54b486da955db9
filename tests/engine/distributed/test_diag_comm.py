"""`fleetserve diag comm`: the layered communication self-test passes on a healthy CPU group
(single host, and across the two "pods" of a group started with the operator's env), and an
induced failure is named at its layer with the likely cause, within its bound."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fleetserve.engine.distributed.diag_comm import CAUSES, LAYERS
from tests.engine.distributed.test_multipod import POD_IPS, group_spec, pod_commands

pytestmark = [pytest.mark.slow]
# NOTE: the pods bind fixed ports (8000, 29500, as the operator renders them), as the dev
# cluster's local pods do: under `pytest -n` this module runs on the k8s tests' worker, never
# beside them (`SHARED_PORT_MODULES` in tests/conftest.py).

DIAG = [sys.executable, "-m", "fleetserve", "diag", "comm", "--json"]


def _results(out: str) -> list[dict[str, str]]:
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def _run(*flags: str, env: dict[str, str] | None = None, timeout: float = 120) -> tuple[int, str]:
    done = subprocess.run([*DIAG, *flags], capture_output=True, text=True, timeout=timeout, env=env)
    return done.returncode, done.stdout + done.stderr


@pytest.mark.timeout(300)
def test_a_healthy_two_rank_cpu_group_passes_every_layer() -> None:
    code, out = _run("--world-size", "2", "--timeout", "20")
    assert code == 0, out
    results = _results(out)
    assert sorted((r["rank"], r["layer"]) for r in results) == sorted(
        (rank, layer) for rank in (0, 1) for layer in LAYERS
    )
    status = {(r["rank"], r["layer"]): r["status"] for r in results}
    for rank in (0, 1):
        assert [status[rank, layer] for layer in LAYERS] == ["ok"] * 4 + ["skipped"]
    assert "comm self-test passed" in out


@pytest.mark.timeout(300)
def test_a_rank_that_never_joins_fails_the_rendezvous_within_the_bound() -> None:
    started = time.monotonic()
    code, out = _run("--world-size", "2", "--ranks", "0", "--timeout", "3")
    assert code == 1
    assert time.monotonic() - started < 60
    (result,) = _results(out)
    assert result["layer"] == "rendezvous" and result["status"] == "failed"
    assert "1 of 2 ranks joined within 3 s" in result["detail"]
    assert result["cause"] == CAUSES["rendezvous"]
    assert "FAILED at layer 'rendezvous'" in out


@pytest.mark.timeout(300)
def test_ranks_started_with_different_world_sizes_are_named_on_every_rank(
    tmp_path: Path,
) -> None:
    init = "tcp://127.0.0.1:29613"
    first = subprocess.Popen(
        [*DIAG, "--world-size", "2", "--ranks", "0", "--timeout", "10", "--init-method", init],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    code, out = _run("--world-size", "3", "--ranks", "1", "--timeout", "10", "--init-method", init)
    first_out, _ = first.communicate(timeout=120)
    for rc, text in ((code, out), (first.returncode, first_out)):
        assert rc == 1
        (result,) = _results(text)
        assert result["layer"] == "rendezvous"
        assert "rank 1 was started with world size 3, rank 0 with 2" in result["detail"]


@pytest.mark.timeout(300)
def test_gloo_without_a_usable_interface_fails_at_the_device_layer_on_the_cpu() -> None:
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "no-such-if0"}
    code, out = _run("--world-size", "2", "--timeout", "10", env=env)
    assert code == 1
    results = _results(out)
    assert {r["layer"] for r in results if r["status"] == "ok"} == {"rendezvous"}
    failed = [r for r in results if r["status"] == "failed"]
    assert failed and {r["layer"] for r in failed} == {"device"}
    assert all("no-such-if0" in r["detail"] for r in failed)
    assert failed[0]["cause"] == CAUSES["device/gloo"]


@pytest.mark.timeout(300)
def test_the_pods_of_a_group_run_it_from_the_operators_env(tiny_llama_dir: Path) -> None:
    procs = []
    for _, env in pod_commands(group_spec(tiny_llama_dir)):
        procs.append(
            subprocess.Popen([*DIAG, "--timeout", "20"], env=env, stdout=subprocess.PIPE, text=True)
        )
    outs = [proc.communicate(timeout=200)[0] for proc in procs]
    for pod, (proc, out) in enumerate(zip(procs, outs, strict=True)):
        assert proc.returncode == 0, out
        results = _results(out)
        assert {r["rank"] for r in results} == {pod}  # each pod runs its own rank
        rendezvous = next(r for r in results if r["layer"] == "rendezvous")
        assert rendezvous["detail"] == f"2 ranks at tcp://{POD_IPS[0]}:29499"


@pytest.mark.timeout(300)
def test_a_failing_start_up_self_test_ends_the_pod_before_it_serves(tiny_llama_dir: Path) -> None:
    env = {**os.environ, "FLEETSERVE_COMM_CHECK": "1", "GLOO_SOCKET_IFNAME": "no-such-if0"}
    argv = [sys.executable, "-m", "fleetserve", "serve", str(tiny_llama_dir),
            "--tensor-parallel-size", "2", "--device", "cpu", "--port", "0"]  # fmt: skip
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=200)
    assert done.returncode == 1
    log = done.stdout + done.stderr
    assert "communication self-test failed at layer 'device'" in log
    assert "set GLOO_SOCKET_IFNAME" in log
    assert "started 2 worker processes" not in log  # nothing started past the self-test
