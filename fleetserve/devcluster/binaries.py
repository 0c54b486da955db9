"""Where the dev-cluster binaries live and which versions they must be.

`hack/build-dev-cluster-bin.sh` (run by `make dev-cluster-bin`) builds them into a per-machine
cache folder keyed by the three versions below; this module only finds them. Keep the versions
in sync with the script.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from fleetserve.envs import read_env

__all__ = [
    "ETCD_VERSION",
    "K8S_VERSION",
    "KWOK_VERSION",
    "Binaries",
    "default_bin_dir",
    "find_binaries",
]

K8S_VERSION = "v1.36.1"
"""kube-apiserver, kube-controller-manager and kube-scheduler: kwok v0.8.0's own default release."""
ETCD_VERSION = "v3.6.14"
KWOK_VERSION = "v0.8.0"

BUILD_HINT = "run `make dev-cluster-bin` (bash hack/build-dev-cluster-bin.sh) to build them"


def default_bin_dir() -> Path:
    """The cache folder the build script writes to, honouring the same environment variables.

    `DEV_CLUSTER_BIN` overrides the folder itself; `FLEETSERVE_CACHE` moves the cache root
    (default `~/.cache/fleetserve`).
    """
    explicit = os.environ.get("DEV_CLUSTER_BIN")
    if explicit:
        return Path(explicit)
    root = read_env().cache_root
    return root / "dev-cluster" / f"{K8S_VERSION}-{ETCD_VERSION}-{KWOK_VERSION}" / "bin"


@dataclass(frozen=True, slots=True)
class Binaries:
    """Absolute paths of every executable and data file the cluster needs."""

    bin_dir: Path

    @property
    def etcd(self) -> Path:
        return self.bin_dir / "etcd"

    @property
    def kube_apiserver(self) -> Path:
        return self.bin_dir / "kube-apiserver"

    @property
    def kube_controller_manager(self) -> Path:
        return self.bin_dir / "kube-controller-manager"

    @property
    def kube_scheduler(self) -> Path:
        return self.bin_dir / "kube-scheduler"

    @property
    def kwok(self) -> Path:
        return self.bin_dir / "kwok"

    @property
    def kubectl(self) -> Path:
        """kubectl of the same release, for people (the code itself uses the Python client)."""
        return self.bin_dir / "kubectl"

    @property
    def kwok_stages(self) -> Path:
        """Multi-document YAML of kwok Stage objects (node-initialize, heartbeat, pod lifecycle)."""
        return self.bin_dir / "kwok-stages.yaml"

    def missing(self) -> list[Path]:
        """Paths that do not exist (empty when the cluster can start)."""
        wanted = [
            self.etcd,
            self.kube_apiserver,
            self.kube_controller_manager,
            self.kube_scheduler,
            self.kwok,
            self.kwok_stages,
        ]
        return [p for p in wanted if not p.exists()]


def find_binaries(bin_dir: Path | None = None) -> Binaries:
    """Locate the binaries; raises FileNotFoundError naming what is missing and how to build it."""
    binaries = Binaries(bin_dir or default_bin_dir())
    missing = binaries.missing()
    if missing:
        names = ", ".join(p.name for p in missing)
        raise FileNotFoundError(
            f"dev-cluster binaries missing in {binaries.bin_dir}: {names}; {BUILD_HINT}"
        )
    return binaries
