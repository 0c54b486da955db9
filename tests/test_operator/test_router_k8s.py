"""The operator's own fleet on the dev cluster, through its router (issue 15 acceptance 4).

The CPU SmolLM2 sample applied with kubectl (one prefill and one decode engine and the router,
all on the local node, each a real process at its own 127.x.y.N): the router pod runs
`fleetserve router --discovery kubernetes` as the ServiceAccount the operator rendered, whose Role
lets it read and watch pods and nothing more. A chat completion through the router pod returns
real text, the colocated answer, and went prefill → decode (the router's decision counter and the
decode engine's loaded KV tokens). Scaling decode from 1 to 2 makes the same router process
(no restart) send requests to the new pod.

Needs `fleetserve router` (issue 15): without it the router pod crash-loops and this test fails
at "Ready" (the steps before that: rendered objects, RBAC accepted, the router pod placed on the
local node).
"""

from __future__ import annotations

import json
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from fleetserve.engine.models.bundled import bundled_model_path
from fleetserve.operator.builders import ROUTER_POD_RULES
from tests.devcluster.helpers import poll
from tests.fleet.prometheus import router_decisions, scrape, total, went_prefill_then_decode
from tests.test_operator.helpers import SA_USER, OperatorEnv

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.router]

ROOT = Path(__file__).resolve().parents[2]
SEL = "fleetserve.io/deployment"


def _sample() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(
        (ROOT / "manifests" / "samples" / "cpu-smollm2.yaml").read_text()
    )
    # As in test_cpu_sample_k8s: this machine's model folder and interpreter.
    doc["spec"]["model"]["source"]["uri"] = str(bundled_model_path())
    doc["spec"]["engine"]["command"] = [sys.executable, "-m", "fleetserve"]
    # Three engine pods after the scale-up must fit the local node's advertised CPUs (this
    # machine's count; the processes are not limited).
    doc["spec"]["engine"]["cpu"] = "500m"
    return doc


def _pods(env: OperatorEnv, ns: str, name: str, role: str) -> list[dict[str, Any]]:
    got = env.get("pod", ns, selector=f"{SEL}={name},fleetserve.io/role={role}") or {"items": []}
    return [p for p in got["items"] if not p["metadata"].get("deletionTimestamp")]


def _ready_pod(pod: dict[str, Any]) -> bool:
    return any(
        c["type"] == "Ready" and c["status"] == "True"
        for c in (pod.get("status") or {}).get("conditions", [])
    )


def _post(url: str, body: dict[str, Any], timeout_s: float = 120) -> dict[str, Any]:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as resp:
        result: dict[str, Any] = json.load(resp)
    return result


def _chat(base: str, content: str, max_tokens: int = 12) -> str:
    body = {
        "model": "smollm2",
        "messages": [{"role": "user", "content": content}],
        "max_tokens": max_tokens,
        "temperature": 0.0,
    }
    answer = _post(f"{base}/v1/chat/completions", body)
    return str(answer["choices"][0]["message"]["content"])


def _can_i(env: OperatorEnv, user: str, verb: str, resource: str, ns: str) -> bool:
    out = env.kubectl("auth", "can-i", verb, resource, "-n", ns, "--as", user, check=False)
    return out.stdout.strip() == "yes"


def test_chat_through_the_operators_router_goes_prefill_then_decode_and_scales(
    operator_env: OperatorEnv,
) -> None:
    env = operator_env
    doc = _sample()
    assert doc["spec"]["router"]["replicas"] == 1
    name = doc["metadata"]["name"]
    router = f"{name}-router"
    ns = env.new_namespace("router-sample")
    try:
        env.apply(ns, doc)

        # -- what holds today: the router's identity, accepted by the API server ---------------
        poll("router RoleBinding", lambda: env.get("rolebinding", ns, router), timeout_s=60)
        role = env.get("role", ns, router)
        assert role["rules"] == [{k: list(v) for k, v in rule.items()} for rule in ROUTER_POD_RULES]
        assert role["rules"] == [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}
        ]
        binding = env.get("rolebinding", ns, router)
        assert binding["subjects"][0]["name"] == router and binding["roleRef"]["name"] == router
        assert env.get("serviceaccount", ns, router) is not None
        # The operator (as its own ServiceAccount) created them: RBAC let it grant the Role.
        denied = [
            e["requestURI"]
            for e in env.dc.audit_events(username=SA_USER)
            if e.get("objectRef", {}).get("namespace") == ns and e["responseStatus"]["code"] == 403
        ]
        assert denied == []
        user = f"system:serviceaccount:{ns}:{router}"
        for verb in ("get", "list", "watch"):
            assert _can_i(env, user, verb, "pods", ns), verb
        for verb, resource in (("delete", "pods"), ("create", "pods"), ("list", "secrets"),
                               ("list", "services"), ("list", "endpointslices")):  # fmt: skip
            assert not _can_i(env, user, verb, resource, ns), (verb, resource)
        assert not _can_i(env, user, "list", "pods", "default")
        deploy = env.get("deployment", ns, router)
        pod_spec = deploy["spec"]["template"]["spec"]
        assert pod_spec["serviceAccountName"] == router
        args = pod_spec["containers"][0]["args"]
        assert args[:3] == ["router", "--disaggregation", "always"]
        assert "--prefill-selector" in args and "--decode-selector" in args
        poll("router pod placed", lambda: [p for p in _pods(env, ns, name, "router")
                                           if p["spec"].get("nodeName")], timeout_s=60)  # fmt: skip
        assert _pods(env, ns, name, "router")[0]["spec"]["nodeName"] == env.dc.local_node

        # -- what needs the router: Ready, a chat completion through it ------------------------
        def ready() -> bool:
            st = (env.get("inferencedeployment", ns, name) or {}).get("status") or {}
            return st.get("phase") == "Ready"

        poll("Ready with the router's readiness", ready, timeout_s=300, interval_s=1)
        # The router's discovery ran as its own ServiceAccount (the token the local node hands
        # the pod), and its Role was enough: it read the pods and was never denied.
        calls = env.dc.audit_events(username=user)
        read = {e["verb"] for e in calls if e.get("objectRef", {}).get("resource") == "pods"}
        assert read & {"list", "watch"}, f"the router never read pods as {user}"
        assert [e["requestURI"] for e in calls if e["responseStatus"]["code"] == 403] == []
        (router_pod,) = _pods(env, ns, name, "router")
        uid = router_pod["metadata"]["uid"]
        base = f"http://{router_pod['status']['podIP']}:8080"
        (prefill_pod,) = _pods(env, ns, name, "prefill")
        (decode_pod,) = _pods(env, ns, name, "decode")
        prefill = f"http://{prefill_pod['status']['podIP']}:8000"
        decode = f"http://{decode_pod['status']['podIP']}:8000"
        loaded = total(scrape(decode), "fleetserve:kv_tokens_loaded")
        before = went_prefill_then_decode(router_decisions(scrape(base)))
        question = "Name three primary colours."
        text = _chat(base, question)
        assert text.strip()
        assert text == _chat(prefill, question), "the router's answer is the colocated one"
        assert total(scrape(decode), "fleetserve:kv_tokens_loaded") > loaded
        assert went_prefill_then_decode(router_decisions(scrape(base))) > before

        # -- scale decode 1 → 2: the same router process uses the new pod ---------------------
        env.kubectl("patch", "infd", name, "-n", ns, "--type=merge",
                    "-p", json.dumps({"spec": {"roles": {"decode": {"replicas": 2}}}}))  # fmt: skip

        def new_decode() -> dict[str, Any] | None:
            pods = [p for p in _pods(env, ns, name, "decode") if p["metadata"]["name"] != decode_pod["metadata"]["name"]]  # fmt: skip
            return pods[0] if pods and _ready_pod(pods[0]) else None

        poll("second decode pod ready", new_decode, timeout_s=240, interval_s=1)
        pod2 = new_decode()
        assert pod2 is not None
        decode2 = f"http://{pod2['status']['podIP']}:8000"
        served = 0.0
        deadline = time.monotonic() + 120
        round_ = 0
        errors: list[str] = []

        def one(content: str) -> None:
            try:
                if not _chat(base, content, 24).strip():
                    errors.append(f"no text for {content!r}")
            except Exception as exc:  # every request must get a full answer
                errors.append(f"{content!r}: {exc!r}")

        while served == 0.0 and time.monotonic() < deadline:
            # Distinct prompts, four at a time: neither prefix affinity nor an idle tie keeps
            # every request on the first decode engine.
            threads = [
                threading.Thread(target=one, args=(f"Request {round_}-{i}: a line about {i}.",))
                for i in range(4)
            ]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=180)
            round_ += 1
            served = total(scrape(decode2), "fleetserve:kv_tokens_loaded")
        assert errors == []
        assert served > 0, (
            f"the router sent nothing to {pod2['metadata']['name']} in {round_} rounds"
        )
        (still,) = _pods(env, ns, name, "router")
        assert still["metadata"]["uid"] == uid, "the router pod was replaced"
        assert [s["restartCount"] for s in still["status"]["containerStatuses"]] == [0]
    finally:
        env.kubectl("delete", "infd", "-n", ns, name, "--wait=false", check=False)
        env.delete_namespace(ns)
