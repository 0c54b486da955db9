"""A roll without a gap on the dev cluster's local node (issue 18 acceptance 4): the CPU SmolLM2
sample with one group per role, streaming load through the operator's router, and an image
roll (`engine.image`), which changes the KV compatibility hash, so the old and new revisions
cannot exchange KV, and rolls the router Deployment too. The operator surges a new group per
role, drains the old ones only once both new ones are ready, and the router pairs prefill and
decode within one revision; the new router is ready before the old one stops, and the old one
finishes its streams (`fleetserve.router.serve`). Clients reach the routers as a Service would
send them (its ready pods not being deleted). Polled throughout: each role always has a ready
group that is not draining (from the pods) and a ready group in the status. No request fails
or is cut, and the new revision serves.
"""

from __future__ import annotations

import json
import time

import pytest

from fleetserve.api.compat import role_compatibility_hashes
from fleetserve.api.labels import LABEL_COMPAT, LABEL_DRAINING, LABEL_GROUP
from fleetserve.api.models import InferenceDeploymentSpec
from tests.devcluster.helpers import poll
from tests.fleet.prometheus import scrape, total
from tests.test_operator.helpers import OperatorEnv
from tests.test_operator.test_drain_k8s import (
    StreamLoad,
    condition,
    cpu_sample,
    event_reasons,
    live_pods,
    pod_ready,
    router_address,
    router_endpoints,
    status,
)

pytestmark = [pytest.mark.k8s, pytest.mark.slow, pytest.mark.router]


def _ready_groups(
    env: OperatorEnv, ns: str, name: str, role: str, *, draining: bool = False
) -> dict[str, str]:
    """Group index → compatibility hash of the role's live groups whose pods are all Ready and,
    unless `draining`, none draining (then: what the router may send new requests to; with
    `draining`: every group still up, including the ones finishing their streams)."""
    groups: dict[str, list[bool]] = {}
    hashes: dict[str, str] = {}
    for pod in live_pods(env, ns, name, role):
        labels = pod["metadata"]["labels"]
        index = labels[LABEL_GROUP]
        groups.setdefault(index, []).append(
            pod_ready(pod) and (draining or LABEL_DRAINING not in labels)
        )
        hashes[index] = labels.get(LABEL_COMPAT, "")
    return {i: hashes[i] for i, ok in groups.items() if all(ok)}


def test_a_roll_under_load_keeps_a_ready_group_per_role_and_fails_no_request(
    operator_env: OperatorEnv,
) -> None:
    env = operator_env
    doc = cpu_sample(prefill=1, decode=1)
    name = doc["metadata"]["name"]
    ns = env.new_namespace("roll")
    load: StreamLoad | None = None
    try:
        env.apply(ns, doc)
        poll("Ready", lambda: status(env, ns, name).get("phase") == "Ready",
             timeout_s=420, interval_s=1)  # fmt: skip
        old = role_compatibility_hashes(InferenceDeploymentSpec.model_validate(doc["spec"]))
        doc["spec"]["engine"]["image"] = "fleetserve:dev-2"
        new = role_compatibility_hashes(InferenceDeploymentSpec.model_validate(doc["spec"]))
        assert old["decode"] != new["decode"], "the roll must change the KV hash"
        (old_router,) = live_pods(env, ns, name, "router")
        load = StreamLoad(
            *router_address(env, ns, name), resolve=lambda: router_endpoints(env, ns, name)
        ).start()
        poll("requests served before the roll", lambda: load.ok >= 3, timeout_s=240)
        env.kubectl("patch", "infd", name, "-n", ns, "--type=merge", "-p",
                    json.dumps({"spec": {"engine": {"image": "fleetserve:dev-2"}}}))  # fmt: skip
        fewest = {"prefill": 9, "decode": 9}
        fewest_status = {"prefill": 9, "decode": 9}
        revisions_side_by_side = False

        def rolled() -> bool:
            nonlocal revisions_side_by_side
            up_hashes = set()
            for role in ("prefill", "decode"):
                serving = _ready_groups(env, ns, name, role)
                fewest[role] = min(fewest[role], len(serving))
                # The old groups' drain starts as soon as both new ones are ready, maybe between
                # two polls on a busy machine; while they drain they are still up (finishing
                # their streams), so the surge is seen beside them there.
                up_hashes |= set(_ready_groups(env, ns, name, role, draining=True).values())
            st = status(env, ns, name)
            for role in ("prefill", "decode"):
                ready = st.get("roles", {}).get(role, {}).get("readyReplicas", 0)
                fewest_status[role] = min(fewest_status[role], ready)
            revisions_side_by_side |= up_hashes == {old["decode"], new["decode"]}
            groups = env.get("statefulset", ns, selector=f"fleetserve.io/deployment={name}")
            labels = [g["spec"]["template"]["metadata"]["labels"] for g in groups["items"]]
            return (
                len(labels) == 2
                and {lab[LABEL_COMPAT] for lab in labels} == {new["decode"]}
                and st.get("phase") == "Ready"
                and st.get("observedGeneration") == 2
            )

        poll("the roll", rolled, timeout_s=420, interval_s=0.25)

        def router_rolled() -> bool:
            routers = env.get("pod", ns, selector=f"fleetserve.io/deployment={name},"
                              "fleetserve.io/role=router")["items"]  # fmt: skip
            return len(routers) == 1 and (
                routers[0]["spec"]["containers"][0]["image"] == "fleetserve:dev-2"
                and pod_ready(routers[0])
            )

        poll("the router's roll", router_rolled, timeout_s=180, interval_s=0.5)
        served_at_roll_end = load.ok
        time.sleep(5)
        load.stop()
        assert load.errors == [], load.errors[:5]
        assert fewest == {"prefill": 1, "decode": 1}, fewest
        assert fewest_status == {"prefill": 1, "decode": 1}, fewest_status
        assert revisions_side_by_side, "the surge was never up beside the old revision"
        assert load.ok > served_at_roll_end
        (router,) = live_pods(env, ns, name, "router")
        assert router["metadata"]["name"] != old_router["metadata"]["name"], "no router roll"
        assert router["spec"]["containers"][0]["image"] == "fleetserve:dev-2"
        assert len(load.addresses_seen) >= 2, "the load never went through the new router"
        (decode,) = live_pods(env, ns, name, "decode")
        assert decode["metadata"]["labels"][LABEL_COMPAT] == new["decode"]
        url = f"http://{decode['status']['podIP']}:8000"
        assert total(scrape(url), "fleetserve:kv_tokens_loaded") > 0, "the new pair never served"
        assert condition(status(env, ns, name), "Draining")["status"] == "False"
        reasons = event_reasons(env, ns)
        assert sum(r == "Drained" for r, _ in reasons) == 2, reasons
        assert not [m for r, m in reasons if r == "DrainTimedOut"]
    finally:
        if load is not None:
            load.stop()
        env.kubectl("delete", "infd", "-n", ns, name, "--wait=false", check=False)
        env.delete_namespace(ns)
