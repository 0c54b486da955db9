"""KV-safe drain on the dev cluster's local node (issue 18 acceptance 2): real CPU engines
(the SmolLM2 sample) behind the operator's router, streaming load through the router, and a
scale-down of both roles (2 → 1 groups each) in the middle of it. Every stream must end with
its finish reason and `[DONE]`, no error event and no broken connection; the removed groups are
drained (the router stops sending to them, the operator waits until their requests and producer
leases are gone) and deleted without the timeout cutting them short.

`StreamLoad` is the load both this test and test_roll_k8s.py drive.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleetserve.api.labels import LABEL_DRAINING
from fleetserve.engine.models.bundled import bundled_model_path
from tests.devcluster.helpers import poll
from tests.fleet.prometheus import scrape, total
from tests.test_operator.helpers import OperatorEnv

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.router]

ROOT = Path(__file__).resolve().parents[2]
SEL = "fleetserve.io/deployment"


def cpu_sample(prefill: int, decode: int) -> dict[str, Any]:
    """The CPU SmolLM2 sample with this machine's model folder and interpreter (as in
    test_cpu_sample_k8s), small CPU requests (a roll's surge must fit the local node) and the
    given group counts."""
    doc: dict[str, Any] = yaml.safe_load(
        (ROOT / "manifests" / "samples" / "cpu-smollm2.yaml").read_text()
    )
    doc["spec"]["model"]["source"]["uri"] = str(bundled_model_path())
    doc["spec"]["engine"]["command"] = [sys.executable, "-m", "fleetserve"]
    doc["spec"]["engine"]["cpu"] = "300m"
    doc["spec"]["roles"]["prefill"]["replicas"] = prefill
    doc["spec"]["roles"]["decode"]["replicas"] = decode
    return doc


def role_selector(name: str, role: str) -> str:
    return f"{SEL}={name},fleetserve.io/role={role}"


def role_pods(env: OperatorEnv, ns: str, name: str, role: str) -> list[dict[str, Any]]:
    """Every pod of the role, terminating ones included."""
    got = env.get("pod", ns, selector=role_selector(name, role)) or {"items": []}
    return list(got["items"])


def live_pods(env: OperatorEnv, ns: str, name: str, role: str) -> list[dict[str, Any]]:
    return [p for p in role_pods(env, ns, name, role) if not p["metadata"].get("deletionTimestamp")]


def pod_ready(pod: dict[str, Any]) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in (pod.get("status") or {}).get("conditions", [])
    )


def status(env: OperatorEnv, ns: str, name: str) -> dict[str, Any]:
    return (env.get("inferencedeployment", ns, name) or {}).get("status") or {}


def condition(st: dict[str, Any], kind: str) -> dict[str, Any]:
    return next((c for c in st.get("conditions", []) if c["type"] == kind), {})


def event_reasons(env: OperatorEnv, ns: str) -> list[tuple[str, str]]:
    events = (env.get("events", ns) or {"items": []})["items"]
    return [(e["reason"], e.get("message", "")) for e in events]


class StreamLoad:
    """`workers` threads, each sending streaming chat completions to `host:port` one after the
    other until stopped. A request succeeds only when its stream carries no error event, its
    last choice has a finish reason and it ends with `data: [DONE]`."""

    def __init__(
        self,
        host: str,
        port: int,
        workers: int = 3,
        max_tokens: int = 24,
        resolve: Callable[[], list[tuple[str, int]]] | None = None,
    ) -> None:
        """`resolve`, if given, is called every 0.3 s for the addresses to use (as a Service's
        endpoints: the ready pods not being deleted); each request takes the next one."""
        self.host, self.port, self.max_tokens = host, port, max_tokens
        self._resolve = resolve
        self._addresses = [(host, port)]
        self._turn = 0
        self.addresses_seen: set[tuple[str, int]] = {(host, port)}
        self.ok = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(workers)
        ]

    def start(self) -> StreamLoad:
        if self._resolve is not None:
            self._threads.append(threading.Thread(target=self._resolver, daemon=True))
        for t in self._threads:
            t.start()
        return self

    def _resolver(self) -> None:
        assert self._resolve is not None
        while not self._stop.wait(0.3):
            with contextlib.suppress(Exception):  # a failed lookup keeps the last endpoints
                if addresses := self._resolve():
                    with self._lock:
                        self._addresses = addresses
                        self.addresses_seen |= set(addresses)

    def _address(self) -> tuple[str, int]:
        with self._lock:
            self._turn += 1
            return self._addresses[self._turn % len(self._addresses)]

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(timeout=180)
        assert not any(t.is_alive() for t in self._threads), "a request hung"

    def _run(self, worker: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            problem = self._one(f"Request {worker}-{n}: write one line about the number {n}.")
            with self._lock:
                if problem is None:
                    self.ok += 1
                else:
                    self.errors.append(problem)

    def _one(self, content: str) -> str | None:
        body = {
            "model": "smollm2",
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "stream": True,
        }
        conn = http.client.HTTPConnection(*self._address(), timeout=120)
        try:
            conn.request("POST", "/v1/chat/completions", json.dumps(body),
                         {"Content-Type": "application/json"})  # fmt: skip
            resp = conn.getresponse()
            if resp.status != 200:
                return f"{content!r}: HTTP {resp.status} {resp.read()[:300]!r}"
            finish, done = None, False
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data:"):
                    continue
                data = line.removeprefix("data:").strip()
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    return f"{content!r}: error event {chunk['error']}"
                for choice in chunk.get("choices", []):
                    finish = choice.get("finish_reason") or finish
            if not done or finish is None:
                return f"{content!r}: stream cut (done={done}, finish_reason={finish})"
            return None
        except (OSError, http.client.HTTPException, ValueError) as exc:
            return f"{content!r}: {exc!r}"
        finally:
            conn.close()


def router_address(env: OperatorEnv, ns: str, name: str) -> tuple[str, int]:
    (router,) = live_pods(env, ns, name, "router")
    return router["status"]["podIP"], 8080


def router_endpoints(env: OperatorEnv, ns: str, name: str) -> list[tuple[str, int]]:
    """The router Service's endpoints as kube-proxy would use them: its ready pods that are
    not being deleted (the dev cluster has no Service proxy)."""
    return [(p["status"]["podIP"], 8080) for p in live_pods(env, ns, name, "router")
            if pod_ready(p)]  # fmt: skip


def test_scale_down_under_load_cuts_no_request(operator_env: OperatorEnv) -> None:
    env = operator_env
    doc = cpu_sample(prefill=2, decode=2)
    name = doc["metadata"]["name"]
    ns = env.new_namespace("drain")
    load: StreamLoad | None = None
    try:
        env.apply(ns, doc)
        poll("Ready", lambda: status(env, ns, name).get("phase") == "Ready",
             timeout_s=420, interval_s=1)  # fmt: skip
        engines = {
            role: [f"http://{p['status']['podIP']}:8000" for p in live_pods(env, ns, name, role)]
            for role in ("prefill", "decode")
        }
        assert [len(v) for v in engines.values()] == [2, 2]
        load = StreamLoad(*router_address(env, ns, name), workers=4, max_tokens=48).start()

        def every_engine_served() -> bool:
            return all(
                total(scrape(u), "vllm:prompt_tokens") > 0
                for urls in engines.values()
                for u in urls
            )

        # Both groups of each role carry traffic, so removing one removes a busy engine.
        poll("every engine served", every_engine_served, timeout_s=240, interval_s=1)
        # The groups that drain (group 1 of each role) must be busy when the drain begins: what
        # is in flight on them must finish there, not be cut. So the scale-down is ordered only
        # once a request is in flight on them (load alone may leave them idle for a moment).
        victims = {
            role: next(
                f"http://{p['status']['podIP']}:8000"
                for p in live_pods(env, ns, name, role)
                if p["metadata"]["labels"]["fleetserve.io/group"] == "1"
            )
            for role in ("prefill", "decode")
        }

        def in_flight_on_victims() -> float:
            return sum(
                total(scrape(url), metric)
                for url in victims.values()
                for metric in (
                    "vllm:num_requests_running",
                    "vllm:num_requests_waiting",
                    "fleetserve:kv_active_leases",
                )
            )

        poll("a request in flight on the groups to drain", lambda: in_flight_on_victims() >= 1,
             timeout_s=120, interval_s=0.1)  # fmt: skip
        served_before = load.ok
        env.kubectl("patch", "infd", name, "-n", ns, "--type=merge", "-p", json.dumps(
            {"spec": {"roles": {"prefill": {"replicas": 1}, "decode": {"replicas": 1}}}}))  # fmt: skip
        seen_draining: set[str] = set()
        seen_condition: list[str] = []

        def one_group_each() -> bool:
            draining = condition(status(env, ns, name), "Draining")
            if draining.get("status") == "True":
                seen_condition.append(draining["message"])
            groups = {}
            for role in ("prefill", "decode"):
                # Terminating pods too: an idle group is labelled, found done at the next drain
                # poll (2 s) and deleted, and a poll here (several kubectl calls) can miss that
                # window; the label stays on the pod while it terminates.
                seen_draining.update(
                    p["metadata"]["name"]
                    for p in role_pods(env, ns, name, role)
                    if LABEL_DRAINING in p["metadata"]["labels"]
                )
                items = env.get("statefulset", ns, selector=role_selector(name, role))
                groups[role] = len(items["items"])
            return groups == {"prefill": 1, "decode": 1}

        poll("the drained groups deleted", one_group_each, timeout_s=300, interval_s=0.5)
        time.sleep(5)  # the load goes on against what is left
        load.stop()
        assert load.errors == [], load.errors[:5]
        assert load.ok > served_before, "no request completed during the scale-down"
        assert len(seen_draining) == 2, seen_draining
        st = status(env, ns, name)
        assert condition(st, "Draining")["status"] == "False"
        assert seen_condition, "the Draining condition never named the draining groups"
        reasons = event_reasons(env, ns)
        assert sum(r == "Drained" for r, _ in reasons) == 2, reasons
        assert not [m for r, m in reasons if r == "DrainTimedOut"]
        assert (
            st["roles"]["prefill"]["readyReplicas"] == st["roles"]["decode"]["readyReplicas"] == 1
        )
    finally:
        if load is not None:
            load.stop()
        env.kubectl("delete", "infd", "-n", ns, name, "--wait=false", check=False)
        env.delete_namespace(ns)


def _annotations(env: OperatorEnv, ns: str, sts: str) -> dict[str, str]:
    obj = env.get("statefulset", ns, sts) or {}
    return dict((obj.get("metadata") or {}).get("annotations") or {})


def _group_pods_labelled(env: OperatorEnv, ns: str, name: str, index: int) -> list[bool]:
    selector = f"{role_selector(name, 'decode')},fleetserve.io/group={index}"
    pods = (env.get("pod", ns, selector=selector) or {"items": []})["items"]
    return [LABEL_DRAINING in p["metadata"]["labels"] for p in pods]


def test_scale_up_cancels_a_drain_and_a_restarted_operator_resumes_one(
    operator_env: OperatorEnv,
) -> None:
    """On kwok GPU nodes, whose pods run no engine: their /metrics never answers, so a drain
    waits for its timeout (an unknown count is never taken for zero). Each decode group of the
    sample is one pod (tensor 4 on 4 GPUs)."""
    env = operator_env
    doc: dict[str, Any] = yaml.safe_load(
        (ROOT / "manifests" / "samples" / "dense-pd.yaml").read_text()
    )
    doc["spec"]["roles"]["decode"]["replicas"] = 2
    name = doc["metadata"]["name"]
    sts = f"{name}-decode-1"
    ns = env.new_namespace("drain-state")

    def patch_decode(**fields: int) -> None:
        env.kubectl("patch", "infd", name, "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"roles": {"decode": fields}}}))  # fmt: skip

    try:
        env.apply(ns, doc)
        poll("Ready", lambda: status(env, ns, name).get("phase") == "Ready", timeout_s=90)
        patch_decode(replicas=1)
        poll("decode-1 draining", lambda: "fleetserve.io/draining-since" in _annotations(env, ns, sts)
             and _group_pods_labelled(env, ns, name, 1) == [True])  # fmt: skip
        assert _annotations(env, ns, sts)["fleetserve.io/drain-reason"] == "scale-down"
        assert _group_pods_labelled(env, ns, name, 0) == [False]
        draining = poll("Draining condition", lambda: condition(status(env, ns, name), "Draining")
                        .get("status") == "True" and condition(status(env, ns, name), "Draining"))  # fmt: skip
        assert draining["message"].startswith("decode group 1 (scale-down) since ")
        # Still draining after the settle time: the engine-less pods' count is unknown.
        time.sleep(8)
        assert "fleetserve.io/draining-since" in _annotations(env, ns, sts)

        # A scale-up cancels the drain instead of creating a group.
        patch_decode(replicas=2)
        poll("drain cancelled", lambda: "fleetserve.io/draining-since" not in _annotations(env, ns, sts)
             and _group_pods_labelled(env, ns, name, 1) == [False])  # fmt: skip
        poll("Ready again", lambda: status(env, ns, name).get("phase") == "Ready", timeout_s=60)
        items = env.get("statefulset", ns, selector=role_selector(name, "decode"))
        assert sorted(i["metadata"]["name"] for i in items["items"]) == [f"{name}-decode-0", sts]
        assert "DrainCancelled" in [r for r, _ in event_reasons(env, ns)]

        # A drain survives an operator restart: its start lives on the StatefulSet.
        patch_decode(replicas=1, drainTimeoutSeconds=20)
        since = poll(
            "drain again", lambda: _annotations(env, ns, sts).get("fleetserve.io/draining-since")
        )
        env.stop()
        time.sleep(3)
        env.start()
        poll(
            "deleted at its timeout", lambda: env.get("statefulset", ns, sts) is None, timeout_s=90
        )
        # NOTE: the operator posts a pass's events after the pass's deletes: poll, not read.
        timed_out = poll(
            "the DrainTimedOut event",
            lambda: next((m for r, m in event_reasons(env, ns) if r == "DrainTimedOut"), None),
        )
        assert [r for r, _ in event_reasons(env, ns)].count("DrainTimedOut") == 1
        assert "an unknown number of requests" in timed_out, timed_out
        age = int(timed_out.split(" after ")[1].split("s ")[0])
        assert 20 <= age < 60, (since, timed_out)
        assert _group_pods_labelled(env, ns, name, 0) == [False]
    finally:
        env.kubectl("delete", "infd", "-n", ns, name, "--wait=false", check=False)
        env.delete_namespace(ns)
