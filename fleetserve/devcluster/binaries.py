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
    "KUEUE_BUILD_HINT",
    "KUEUE_VERSION",
    "KWOK_VERSION",
    "Binaries",
    "default_bin_dir",
    "find_binaries",
]

K8S_VERSION = "v1.36.1"
"""kube-apiserver, kube-controller-manager and kube-scheduler: kwok v0.8.0's own default release."""
ETCD_VERSION = "v3.6.14"
KWOK_VERSION = "v0.8.0"
KUEUE_VERSION = "v0.17.0"
"""Gang admission (`fleetserve dev-cluster up --kueue`). Built into the same folder, checked by
its own version, so the folder's name (and the other binaries) do not depend on it."""

BUILD_HINT = "run `make dev-cluster-bin` (bash hack/build-dev-cluster-bin.sh) to build them"
KUEUE_BUILD_HINT = f"run `make dev-cluster-bin` (it builds Kueue {KUEUE_VERSION} too)"


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

    @property
    def kueue(self) -> Path:
        """The Kueue manager (its cmd/kueue); optional: only `up --kueue` runs it."""
        return self.bin_dir / "kueue"

    @property
    def kueue_crds(self) -> Path:
        """Multi-document YAML of Kueue's CRDs (its config/components/crd/bases)."""
        return self.bin_dir / "kueue-crds.yaml"

    @property
    def kueue_webhooks(self) -> Path:
        """Kueue's webhook configurations (its config/components/webhook/manifests.yaml)."""
        return self.bin_dir / "kueue-webhooks.yaml"

    def kueue_missing(self) -> list[Path]:
        """Kueue's files that do not exist (empty when Kueue can run)."""
        return [p for p in (self.kueue, self.kueue_crds, self.kueue_webhooks) if not p.exists()]

    def require_kueue(self) -> None:
        """Raises FileNotFoundError naming Kueue's missing files and how to build them."""
        missing = self.kueue_missing()
        if missing:
            names = ", ".join(p.name for p in missing)
            raise FileNotFoundError(f"Kueue missing in {self.bin_dir}: {names}; {KUEUE_BUILD_HINT}")

    def missing(self) -> list[Path]:
        """Paths that do not exist (empty when the cluster can start; Kueue is not needed)."""
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
