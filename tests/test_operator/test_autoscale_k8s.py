"""The autoscaling loop on `fleetserve dev-cluster` with simulated engines (issue 18, acceptance 1).

The engine pods are `fleetserve.operator.autoscale.sim_pod` processes on the local node: torch-free
queueing models whose load follows a trace file the test rewrites (each pod takes its share:
rate ÷ the pods of its role alive). The operator runs as a subprocess with its own
ServiceAccount, scrapes the pods' /metrics, and writes its decisions to status; the reconcile
creates and deletes the groups. One run, in phases: a noisy steady load (no flapping), a step up
in prompt backlog (prefill scales up within the scale-up window; the P:D band pulls decode
along; max holds), and a drop (no scale-down before the scale-down window; min holds).
"""

from __future__ import annotations

import itertools
import json
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client

from fleetserve.api.models import GROUP, PLURAL, VERSION, Autoscaling
from fleetserve.devcluster.binaries import find_binaries
from fleetserve.devcluster.testing import DevCluster
from tests.devcluster.helpers import poll
from tests.test_operator.helpers import OperatorEnv

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

LOCAL = {
    "nodeSelector": {"fleetserve.io/local-node": "true"},
    "tolerations": [
        {"key": "fleetserve.io/local-node", "operator": "Exists", "effect": "NoSchedule"}
    ],
}
# The default interval and scale-up window (the decision-latency figure is for those). The
# scale-down window is 120 s while the noisy steady load runs (the default, 300 s, would only make
# flapping rarer) and 14 s for the drop, so the test does not wait minutes.
INTERVAL_S = Autoscaling().interval_seconds
UP_S = Autoscaling().scale_up_stabilization_seconds
STEADY_DOWN_S = 120.0
DOWN_S = 14.0


@dataclass
class MetricsOperator(OperatorEnv):
    """The operator subprocess with its metrics endpoint on `metrics_address`."""

    metrics_address: str = "127.0.0.1:18481"


@pytest.fixture(scope="module")
def scaling_operator(
    dev_cluster: DevCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[MetricsOperator]:
    env = MetricsOperator(
        dev_cluster, find_binaries().bin_dir / "kubectl", Path(), tmp_path_factory.mktemp("op")
    )
    env.install()
    env.start()
    try:
        yield env
    finally:
        env.stop()


def _write_trace(path: Path, trace: str, t0: float) -> float:
    """Atomically point every sim pod at `trace` (starting at `t0`); returns when it was written."""
    tmp = path.with_suffix(".tmp")
    doc = {"t0": t0, "trace": trace, "prompt_tokens": 8192, "output_tokens": 256}
    tmp.write_text(json.dumps({**doc, "prefill_tokens_per_s": 16000}))
    tmp.replace(path)
    return time.time()


def _doc(name: str, trace: Path, peers: Path) -> dict[str, Any]:
    role = {"replicas": 1, "gpusPerPod": 0, **LOCAL}
    return {
        "apiVersion": f"{GROUP}/{VERSION}",
        "kind": "InferenceDeployment",
        "metadata": {"name": name},
        "spec": {
            "model": {"name": "sim", "source": {"uri": "/sim"}},
            "engine": {
                "command": [sys.executable, "-m", "fleetserve.operator.autoscale.sim_pod"],
                "args": {"sim-trace": str(trace), "sim-peers": str(peers)},
                "cpu": "10m",
                "memory": "64Mi",
            },
            "roles": {"prefill": role, "decode": role},
            # No router: it is ready only after a real generation, which sim pods do not serve.
            "router": {"replicas": 0},
            "autoscaling": {
                "enabled": True,
                "prefill": {"min": 1, "max": 5, "targetTTFTSeconds": 2.0, "tokensPerSecond": 16000},
                "decode": {"min": 1, "max": 3, "targetITLSeconds": 0.05, "maxKVUsage": 0.8},
                "ratio": {"min": 0.5, "max": 2.0},
                "intervalSeconds": INTERVAL_S,
                "scaleUpStabilizationSeconds": UP_S,
                "scaleDownStabilizationSeconds": STEADY_DOWN_S,
                "tolerance": 0.1,
            },
        },
    }


@dataclass
class Recorder:
    """Polls the deployment's status every 0.25 s: (wall time, desired prefill, desired decode)."""

    api: client.CustomObjectsApi
    namespace: str
    name: str
    rows: list[tuple[float, int, int]] = field(default_factory=list)
    last: dict[str, Any] = field(default_factory=dict)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.wait(0.25):
            try:
                obj = self.api.get_namespaced_custom_object(
                    GROUP, VERSION, self.namespace, PLURAL, self.name
                )
            except client.ApiException:
                continue
            st = obj.get("status") or {}
            roles = st.get("roles") or {}
            p = (roles.get("prefill") or {}).get("desiredReplicas")
            d = (roles.get("decode") or {}).get("desiredReplicas")
            if p is not None and d is not None:
                self.rows.append((time.time(), p, d))
                self.last = st

    def since(self, t: float) -> list[tuple[float, int, int]]:
        return [r for r in self.rows if r[0] >= t]


def test_prefill_follows_the_backlog_within_the_windows_and_bounds(
    scaling_operator: MetricsOperator, dev_cluster: DevCluster, tmp_path: Path
) -> None:
    env = scaling_operator
    ns = env.new_namespace("autoscale")
    name = "sim"
    trace, peers = tmp_path / "trace.json", tmp_path / "peers"
    t0 = time.time()
    # Phase 1, noisy steady: 2.6 req/s ±15% of 8k-token prompts, a need of 1.3–1.8 prefill
    # replicas. (A load whose need straddles a whole number moves at each short scale-down
    # window, as HPA's would: the default window is 300 s, this test's 14 s.)
    _write_trace(trace, "steady:rate=2.6,noise=0.15", t0)
    env.apply(ns, _doc(name, trace, peers))
    with dev_cluster.api_client() as api:
        rec = Recorder(client.CustomObjectsApi(api), ns, name)
        thread = threading.Thread(target=rec.run, daemon=True)
        thread.start()
        try:
            _run_phases(env, rec, ns, name, trace, t0)
        finally:
            rec.stop.set()
            thread.join()
            env.kubectl("delete", "infd", "-n", ns, name, "--wait=false", check=False)
            env.delete_namespace(ns)


def _run_phases(
    env: MetricsOperator, rec: Recorder, ns: str, name: str, trace: Path, t0: float
) -> None:
    poll("a first scale decision", lambda: rec.rows, timeout_s=120, interval_s=0.5)
    # The first pod is overloaded until a second one is ready, and the backlog it built up
    # drains: a short window brings the size down to the load's, then the steady window holds.
    env.kubectl("patch", "infd", name, "-n", ns, "--type=merge", "-p",
                json.dumps({"spec": {"autoscaling": {"scaleDownStabilizationSeconds": DOWN_S}}}))  # fmt: skip
    hold_s = DOWN_S + 3

    def settled() -> bool:
        recent = rec.since(time.time() - hold_s)
        return (
            bool(recent)
            and time.time() - rec.rows[0][0] >= hold_s
            and len({r[1:] for r in recent}) == 1
            # the load's own size (a need of 1.3-1.8, 3 with a noise peak), not the start-up
            # backlog's, which the scale-down window may still be holding
            and recent[-1][1] in (2, 3)
        )

    poll("a settled size under the steady load", settled, timeout_s=150, interval_s=1)
    env.kubectl("patch", "infd", name, "-n", ns, "--type=merge", "-p",
                json.dumps({"spec": {"autoscaling": {"scaleDownStabilizationSeconds": STEADY_DOWN_S}}}))  # fmt: skip
    start = time.time()
    time.sleep(60)
    steady = [r[1:] for r in rec.since(start)]
    moves = [(a, b) for a, b in itertools.pairwise(steady) if a != b]
    # A noise peak may still move a role up once (and the window then holds it); a move and its
    # reversal would be flapping.
    assert len(moves) <= 1 and all(b[0] >= a[0] for a, b in moves), f"flapping: {moves}"

    # Phase 2, step: 10 req/s (≈ 82k prompt tokens/s against 16k per replica) → prefill max 5.
    stepped = _write_trace(trace, "steady:rate=10", t0)
    poll("prefill scaled up", lambda: rec.rows[-1][1] > steady[-1][0], timeout_s=30, interval_s=0.2)
    latency = next(r[0] for r in rec.since(stepped) if r[1] > steady[-1][0]) - stepped
    print(f"decision latency from the load step to desiredReplicas: {latency:.2f}s")
    # The first scrape after the step (an interval) sees the backlog grow, the window then needs
    # UP_S of such recommendations; the pods re-read the trace each second, and a second of
    # slack for this shared machine.
    assert latency <= INTERVAL_S + UP_S + 2.0, latency
    poll("prefill at its max", lambda: rec.rows[-1][1] == 5, timeout_s=40, interval_s=0.5)
    poll("decode pulled up by the P:D band", lambda: rec.rows[-1][2] >= 3, timeout_s=20)
    groups = poll(
        "5 prefill StatefulSets",
        lambda: (
            len(env.get("statefulset", ns, selector="fleetserve.io/role=prefill")["items"]) == 5
        ),
        timeout_s=30,
    )
    assert groups
    decision = rec.last["lastScaleDecision"]
    assert decision["inputs"]["prefill_tokens_arriving_per_s"] > 16000
    assert decision["roles"]["prefill"]["desired"] == 5

    # Phase 3, drop: 0.2 req/s. Nothing shrinks before the scale-down window, then min holds.
    env.kubectl("patch", "infd", name, "-n", ns, "--type=merge", "-p",
                json.dumps({"spec": {"autoscaling": {"scaleDownStabilizationSeconds": DOWN_S}}}))  # fmt: skip
    time.sleep(2 * INTERVAL_S)  # the next ticks read the new window
    dropped = _write_trace(trace, "steady:rate=0.2", t0)
    poll("prefill scaled down", lambda: rec.rows[-1][1] < 5, timeout_s=DOWN_S + 30, interval_s=0.5)
    first_down = next(r[0] for r in rec.since(dropped) if r[1] < 5)
    assert first_down - dropped >= DOWN_S - INTERVAL_S, first_down - dropped
    poll("prefill at its min", lambda: rec.rows[-1][1:] == (1, 1), timeout_s=DOWN_S + 30)

    rows = rec.since(t0)
    assert all(1 <= p <= 5 and 1 <= d <= 3 for _, p, d in rows), rows
    assert all(0.5 <= p / d <= 2.0 for _, p, d in rows), rows
    events = env.get("event", ns)["items"]
    scaled = [e for e in events if e.get("reason") == "Scaled"]
    assert scaled and any("prefill" in e["message"] for e in scaled)
    with urllib.request.urlopen(f"http://{env.metrics_address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    assert (
        f'fleetserve:autoscaler_desired_replicas{{deployment="{name}",namespace="{ns}",role="prefill"}}'
        in text
    )
    assert 'fleetserve:autoscaler_decisions_total{deployment="sim",direction="up"' in text
