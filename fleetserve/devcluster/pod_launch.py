"""Turn a Pod (camelCase JSON dict, `status.podIP` already chosen) into process launches.

This is the only place that writes a pod's local folders: emptyDirs, and the files of configMap
and secret volumes. The translation itself is in `podspec` (pure, unit-tested).
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fleetserve.devcluster.podspec import (
    Lookup,
    PodIP,
    Probe,
    build_env,
    expand_vars,
    map_volumes,
    mount_table,
    parse_probe,
    rewrite_paths,
    volume_files,
)

__all__ = ["ContainerLaunch", "PodLaunch", "build_launch", "log_path"]


def log_path(logs_dir: Path, namespace: str, pod: str, container: str) -> Path:
    """Where a container's stdout+stderr go (all restarts appended)."""
    return logs_dir / f"{namespace}_{pod}_{container}.log"


@dataclass(frozen=True, slots=True)
class ContainerLaunch:
    """Everything needed to (re)start one container process."""

    name: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    cwd: Path
    log: Path
    pod_ip: str
    readiness: Probe | None = None
    liveness: Probe | None = None
    image: str = ""


@dataclass(frozen=True, slots=True)
class PodLaunch:
    """A pod's init containers (run one after another, each to success) and its containers."""

    init: tuple[ContainerLaunch, ...]
    containers: tuple[ContainerLaunch, ...]


def _write_volumes(
    pod: Mapping[str, Any], volumes: Mapping[str, Path], configmap: Lookup, secret: Lookup
) -> None:
    namespace = pod["metadata"]["namespace"]
    for volume in pod["spec"].get("volumes", []):
        if "configMap" in volume or "secret" in volume:
            files = volume_files(volume, namespace, configmap=configmap, secret=secret)
            for rel, content in files.items():
                path = volumes[volume["name"]] / rel
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(content)
        if "emptyDir" in volume or "configMap" in volume or "secret" in volume:
            volumes[volume["name"]].mkdir(parents=True, exist_ok=True)


def _container_launch(
    pod: Mapping[str, Any],
    c: Mapping[str, Any],
    *,
    volumes: Mapping[str, Path],
    pod_dir: Path,
    logs_dir: Path,
    base_env: Mapping[str, str],
    configmap: Lookup,
    secret: Lookup,
    pod_ip: PodIP | None,
) -> ContainerLaunch:
    if not c.get("command"):
        raise ValueError(f"container {c['name']!r} has no command; the local node ignores images")
    meta = pod["metadata"]
    mounts = mount_table(c, volumes)
    env = build_env(pod, c, base=base_env, configmap=configmap, secret=secret, pod_ip=pod_ip)
    env = {k: rewrite_paths(v, mounts) for k, v in env.items()}
    argv = [rewrite_paths(expand_vars(a, env), mounts) for a in [*c["command"], *c.get("args", [])]]
    cwd = Path(rewrite_paths(c["workingDir"], mounts)) if c.get("workingDir") else pod_dir
    return ContainerLaunch(
        name=c["name"],
        argv=tuple(argv),
        env=env,
        cwd=cwd,
        log=log_path(logs_dir, meta["namespace"], meta["name"], c["name"]),
        pod_ip=pod["status"]["podIP"],
        readiness=parse_probe(c.get("readinessProbe"), c),
        liveness=parse_probe(c.get("livenessProbe"), c),
        image=c.get("image", ""),
    )


def build_launch(
    pod: Mapping[str, Any],
    *,
    pod_dir: Path,
    logs_dir: Path,
    base_env: Mapping[str, str],
    configmap: Lookup,
    secret: Lookup,
    pod_ip: PodIP | None = None,
) -> PodLaunch:
    """Translate the pod's init containers and containers; write its volumes under `pod_dir`.

    `pod_ip` resolves env values that are pod DNS records (`podspec.build_env`).

    Raises:
        ValueError: a container has no `command` (the image's entrypoint is unknown here) or an
            unsupported probe/fieldRef.
        LookupError: a referenced ConfigMap/Secret is missing, or a pod named by its DNS record
            has no IP yet (the agent retries).
    """
    volumes = map_volumes(pod, pod_dir)
    _write_volumes(pod, volumes, configmap, secret)
    make = functools.partial(
        _container_launch, pod, volumes=volumes, pod_dir=pod_dir, logs_dir=logs_dir,
        base_env=base_env, configmap=configmap, secret=secret, pod_ip=pod_ip,
    )  # fmt: skip
    spec = pod["spec"]
    return PodLaunch(
        init=tuple(make(c) for c in spec.get("initContainers", [])),
        containers=tuple(make(c) for c in spec["containers"]),
    )
