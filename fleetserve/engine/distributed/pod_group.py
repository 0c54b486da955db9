"""`PodGroup`: where this pod sits in a replica group that spans several pods.

The operator renders the same env into every pod of a group (`fleetserve.operator.render`):
`FLEETSERVE_RANK` (the pod's index, pod 0 leads), `FLEETSERVE_WORLD_SIZE` (ranks of the group),
`FLEETSERVE_GROUP_SIZE` (pods of the group) and `FLEETSERVE_LEADER_ADDRESS` (pod 0's address).
Every pod runs world_size / group_size consecutive global ranks, pod p the ranks
[p × ranks_per_pod, (p + 1) × ranks_per_pod): with TP fastest-varying in the rank layout, a pod
holds whole tensor-parallel groups whenever ranks_per_pod is a multiple of TP, so the chatty
all-reduces stay inside a pod and only pipeline sends cross pods.

Only the leader (pod 0) runs the API server, the scheduler and the executor; the other pods run
worker processes only (`fleetserve.engine.distributed.follower`). Everything meets at the leader:

- the torch.distributed rendezvous: a TCP store at `leader:GROUP_PORT`, hosted by global rank 0,
  which is the leader's first local rank;
- the executor's control sockets (ZMQ over TCP): the driver's results at `leader:CONTROL_PORT`,
  the calls to global rank r at `leader:CONTROL_PORT + 1 + r`. The leader binds them at its pod
  IP (pods on the dev cluster's local node share the host network, each with its own loopback
  address); local ranks keep their ipc sockets.

This module reads no environment itself (`fleetserve.envs` does) and imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetserve.envs import Env, env_name

__all__ = ["CONTROL_PORT", "DIAG_PORT", "GROUP_PORT", "PodGroup", "pod_group"]

GROUP_PORT = 29500
"""torch.distributed's TCP store on the leader (torch's customary MASTER_PORT)."""
DIAG_PORT = 29499
"""The TCP store of `fleetserve diag comm` on the leader (apart from the engine's, so that the
self-test can run while, or before, the group starts)."""
CONTROL_PORT = 29501
"""The executor's results socket on the leader; rank r's calls come from CONTROL_PORT + 1 + r."""


@dataclass(frozen=True, slots=True)
class PodGroup:
    """One pod's view of its multi-pod replica group (see the module docstring)."""

    pod_index: int
    num_pods: int
    world_size: int
    leader_address: str
    pod_ip: str | None = None
    """This pod's IP, where the leader binds its control sockets (None: every interface)."""

    def __post_init__(self) -> None:
        if self.num_pods < 2:
            raise ValueError(f"num_pods must be >= 2 for a multi-pod group, got {self.num_pods}")
        if not 0 <= self.pod_index < self.num_pods:
            raise ValueError(
                f"{env_name('rank')} (the pod index) must be in [0, {self.num_pods}), "
                f"got {self.pod_index}"
            )
        if self.world_size % self.num_pods:
            raise ValueError(
                f"{env_name('world_size')}={self.world_size} must be a multiple of "
                f"{env_name('group_size')}={self.num_pods} (every pod runs as many ranks)"
            )
        if not self.leader_address:
            raise ValueError(f"{env_name('leader_address')} must be set in a multi-pod group")

    @property
    def ranks_per_pod(self) -> int:
        return self.world_size // self.num_pods

    @property
    def local_ranks(self) -> range:
        """The global ranks this pod runs."""
        first = self.pod_index * self.ranks_per_pod
        return range(first, first + self.ranks_per_pod)

    def pod_of(self, rank: int) -> int:
        """The index of the pod that runs global `rank`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        return rank // self.ranks_per_pod

    @property
    def is_leader(self) -> bool:
        return self.pod_index == 0

    @property
    def init_method(self) -> str:
        """The torch.distributed rendezvous every rank of the group joins."""
        return f"tcp://{self.leader_address}:{GROUP_PORT}"

    @property
    def results_endpoint(self) -> str:
        """Where remote ranks connect to send their replies."""
        return f"tcp://{self.leader_address}:{CONTROL_PORT}"

    def requests_endpoint(self, rank: int) -> str:
        """Where remote `rank` connects to receive its calls."""
        return f"tcp://{self.leader_address}:{CONTROL_PORT + 1 + rank}"

    def bind_endpoint(self, port: int) -> str:
        """The leader's bind address for one of its control `port`s."""
        return f"tcp://{self.pod_ip or '0.0.0.0'}:{port}"


def pod_group(env: Env, world_size: int) -> PodGroup | None:
    """This pod's group from the rendered env, or None for a one-pod group (or no operator).

    Args:
        env: the parsed environment (`fleetserve.envs.read_env()`).
        world_size: the engine's ranks (tensor × pipeline × data), which the env must match.

    Raises:
        ValueError: the env describes an inconsistent group (the message names the variable).
    """
    if env.group_size is None or env.group_size == 1:
        return None
    if env.world_size is not None and env.world_size != world_size:
        raise ValueError(
            f"{env_name('world_size')}={env.world_size} does not match the engine's "
            f"{world_size} ranks (tensor × pipeline × data)"
        )
    if env.rank is None:
        raise ValueError(f"{env_name('rank')} (the pod index) must be set in a multi-pod group")
    return PodGroup(
        pod_index=env.rank,
        num_pods=env.group_size,
        world_size=world_size,
        leader_address=env.leader_address or "",
        pod_ip=env.pod_ip,
    )
