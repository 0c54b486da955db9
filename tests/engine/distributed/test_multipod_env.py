"""`pod_group`: which ranks a pod runs and where it meets its leader, from the rendered env."""

from __future__ import annotations

import pytest

from fleetserve.api.models import InferenceDeploymentSpec
from fleetserve.devcluster.podspec import build_env, pod_dns_name
from fleetserve.engine.distributed.pod_group import CONTROL_PORT, GROUP_PORT, pod_group
from fleetserve.envs import read_env
from fleetserve.operator.render import engine_env


def _env(**values: str) -> dict[str, str]:
    return {f"FLEETSERVE_{k.upper()}": v for k, v in values.items()}


def test_a_one_pod_group_or_no_operator_is_no_pod_group() -> None:
    assert pod_group(read_env({}), 2) is None
    assert pod_group(read_env(_env(group_size="1", rank="0", world_size="2")), 2) is None


def test_the_rendered_env_of_a_two_pod_tp4_pp2_group() -> None:
    spec = InferenceDeploymentSpec.model_validate(
        {
            "model": {"name": "m", "source": {"uri": "/m"}},
            "kvTransfer": {"connector": "none"},
            "roles": {"unified": {"gpusPerPod": 4, "parallelism": {"tensor": 4, "pipeline": 2}}},
        }
    )
    role = spec.roles.unified
    assert role is not None
    rendered = {e["name"]: e.get("value") for e in engine_env(spec, role, "lead.svc")}
    environ = {k: v for k, v in rendered.items() if v is not None}
    first = pod_group(read_env({**environ, "FLEETSERVE_RANK": "0"}), 8)
    second = pod_group(read_env({**environ, "FLEETSERVE_RANK": "1"}), 8)
    assert first is not None and second is not None
    assert first.is_leader and not second.is_leader
    assert list(first.local_ranks) == [0, 1, 2, 3] and list(second.local_ranks) == [4, 5, 6, 7]
    assert second.pod_of(5) == 1 and first.pod_of(3) == 0
    assert second.init_method == f"tcp://lead.svc:{GROUP_PORT}"
    assert second.results_endpoint == f"tcp://lead.svc:{CONTROL_PORT}"
    assert second.requests_endpoint(6) == f"tcp://lead.svc:{CONTROL_PORT + 7}"


@pytest.mark.parametrize(
    ("values", "world", "message"),
    [
        ({"group_size": "2", "rank": "0", "world_size": "4"}, 2, "FLEETSERVE_WORLD_SIZE=4"),
        ({"group_size": "2", "world_size": "2", "leader_address": "a"}, 2, "FLEETSERVE_RANK"),
        ({"group_size": "2", "rank": "2", "leader_address": "a"}, 2, r"FLEETSERVE_RANK.*\[0, 2\)"),
        ({"group_size": "2", "rank": "0", "leader_address": "a"}, 3, "must be a multiple of"),
        ({"group_size": "2", "rank": "1"}, 2, "FLEETSERVE_LEADER_ADDRESS must be set"),
        ({"group_size": "0"}, 2, "FLEETSERVE_GROUP_SIZE must be >= 1"),
    ],
)
def test_an_inconsistent_group_env_is_refused_by_name(
    values: dict[str, str], world: int, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        pod_group(read_env(_env(**values)), world)


def test_the_local_nodes_dns_stand_in_resolves_pod_records_or_defers_the_pod() -> None:
    assert pod_dns_name("g-0.g.ns.svc") == ("ns", "g-0", "g")
    assert pod_dns_name("g-0.g.ns.svc.cluster.local") == ("ns", "g-0", "g")
    assert pod_dns_name("g.ns.svc") is None and pod_dns_name("10.0.0.1") is None
    pod = {"metadata": {"namespace": "ns", "name": "g-1"}, "status": {"podIP": "127.0.0.11"}}
    container = {"env": [{"name": "LEADER", "value": "g-0.g.ns.svc"}, {"name": "X", "value": "y"}]}
    ips = {("ns", "g-0", "g"): "127.0.0.10"}
    env = build_env(
        pod, container, base={}, configmap=lambda *_: None, secret=lambda *_: None,
        pod_ip=lambda *record: ips.get(record),
    )  # fmt: skip
    assert (env["LEADER"], env["X"]) == ("127.0.0.10", "y")
    with pytest.raises(LookupError, match=r"LEADER: pod 'g-0' of g-0\.g\.ns\.svc has no IP yet"):
        build_env(
            pod, container, base={}, configmap=lambda *_: None, secret=lambda *_: None,
            pod_ip=lambda *record: None,
        )  # fmt: skip
