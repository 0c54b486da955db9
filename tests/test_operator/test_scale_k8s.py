"""50 InferenceDeployments at once under kwok (issue 6 acceptance 7: timings, operator CPU/RSS).

Prints apply→all-children and apply→all-Ready times and the operator's CPU seconds and peak RSS.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import yaml

from tests.devcluster.helpers import poll
from tests.test_operator.helpers import OperatorEnv

pytestmark = [pytest.mark.k8s, pytest.mark.slow]

COUNT = 50


def _proc_usage(pid: int) -> tuple[float, int]:
    """(user+system CPU seconds, peak RSS in KiB) of a live process."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    status = Path(f"/proc/{pid}/status").read_text()
    peak = next(line for line in status.splitlines() if line.startswith("VmHWM:"))
    return cpu_s, int(peak.split()[1])


def _doc(i: int) -> dict:
    role = {"replicas": 1, "gpusPerPod": 0}
    return {
        "apiVersion": "fleetserve.io/v1alpha1",
        "kind": "InferenceDeployment",
        "metadata": {"name": f"d{i:02d}"},
        "spec": {
            "model": {"name": "m", "source": {"uri": "/m"}},
            "engine": {"cpu": "10m", "memory": "16Mi"},
            "roles": {"prefill": role, "decode": role},
        },
    }


def test_fifty_deployments_at_once(operator_env: OperatorEnv) -> None:
    env = operator_env
    assert env.proc is not None
    ns = env.new_namespace("fifty")
    try:
        cpu0, _ = _proc_usage(env.proc.pid)
        stream = "\n---\n".join(yaml.safe_dump(_doc(i)) for i in range(COUNT))
        t0 = time.monotonic()
        env.kubectl("apply", "-n", ns, "-f", "-", stdin=stream)

        def children() -> bool:
            items = env.get("statefulset", ns, selector="fleetserve.io/deployment")["items"]
            routers = env.get("service", ns, selector="fleetserve.io/role=router")["items"]
            return len(items) == 2 * COUNT and len(routers) == COUNT

        poll("all children", children, timeout_s=240, interval_s=0.5)
        t_children = time.monotonic() - t0

        def all_ready() -> bool:
            items = env.get("inferencedeployment", ns)["items"]
            return (
                sum(
                    any(
                        c["type"] == "Ready" and c["status"] == "True"
                        for c in (i.get("status") or {}).get("conditions", [])
                    )
                    for i in items
                )
                == COUNT
            )

        poll("all Ready", all_ready, timeout_s=300, interval_s=1)
        t_ready = time.monotonic() - t0
        cpu1, rss_kib = _proc_usage(env.proc.pid)
        print(
            f"\n{COUNT} deployments: children in {t_children:.1f}s, Ready in {t_ready:.1f}s; "
            f"operator CPU {cpu1 - cpu0:.1f}s, peak RSS {rss_kib / 1024:.0f} MiB"
        )
    finally:
        env.delete_namespace(ns)
