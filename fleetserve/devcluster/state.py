"""The state file of a running dev cluster (`<dir>/state.json`).

`up` rewrites it after every process it starts, so a failed or interrupted `up` can still be
cleaned up by `down`, and a second CLI invocation (`status`, `logs`, `down`) finds the cluster.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fleetserve.devcluster.processes import ProcessRecord
from fleetserve.envs import read_env

__all__ = ["ClusterState", "default_cluster_dir", "load_state", "save_state"]

STATE_FILE = "state.json"


def default_cluster_dir() -> Path:
    """`$FLEETSERVE_DEV_CLUSTER_DIR`, else `~/.local/state/fleetserve/dev-cluster`."""
    explicit = read_env().dev_cluster_dir
    if explicit is not None:
        return explicit
    return Path.home() / ".local" / "state" / "fleetserve" / "dev-cluster"


@dataclass(frozen=True, slots=True)
class ClusterState:
    """What `down`, `status` and `logs` need to know about a cluster someone started."""

    dir: Path
    server: str = ""
    """https://127.0.0.1:<port> of kube-apiserver (empty until it is chosen)."""
    ports: dict[str, int] = field(default_factory=dict)
    """Every loopback port the cluster's own processes listen on, by purpose."""
    processes: tuple[ProcessRecord, ...] = ()
    """In start order; `down` stops them in reverse."""
    local_node: str | None = None
    """Name of the local node (None with --no-local-node)."""

    @property
    def kubeconfig(self) -> Path:
        """Admin kubeconfig (client cert in system:masters)."""
        return self.dir / "admin.kubeconfig"

    @property
    def pki_dir(self) -> Path:
        return self.dir / "pki"

    @property
    def logs_dir(self) -> Path:
        """Control-plane logs (`<name>.log`) and, under `pods/`, the local node's container logs."""
        return self.dir / "logs"

    @property
    def local_node_dir(self) -> Path:
        """The local node agent's state (pod folders, `pods.json` with the live process groups)."""
        return self.dir / "local-node"

    def with_process(self, record: ProcessRecord) -> ClusterState:
        return replace(self, processes=(*self.processes, record))

    def to_json(self) -> dict[str, Any]:
        return {
            "dir": str(self.dir),
            "server": self.server,
            "ports": self.ports,
            "processes": [p.to_json() for p in self.processes],
            "local_node": self.local_node,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClusterState:
        return cls(
            dir=Path(data["dir"]),
            server=data["server"],
            ports={k: int(v) for k, v in data["ports"].items()},
            processes=tuple(ProcessRecord.from_json(p) for p in data["processes"]),
            local_node=data.get("local_node"),
        )


def save_state(state: ClusterState) -> None:
    """Atomically write `<dir>/state.json`."""
    tmp = state.dir / (STATE_FILE + ".tmp")
    tmp.write_text(json.dumps(state.to_json(), indent=2))
    tmp.replace(state.dir / STATE_FILE)


def load_state(dir: Path) -> ClusterState | None:
    """The state in `dir`, or None when no cluster was started there."""
    path = dir / STATE_FILE
    if not path.exists():
        return None
    return ClusterState.from_json(json.loads(path.read_text()))
