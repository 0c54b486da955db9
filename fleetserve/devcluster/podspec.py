"""Pure translations of a Pod (as a camelCase JSON dict) into what the local node runs.

Nothing here touches processes or the API, so it is unit-tested on plain dicts:
environment (`env`, `envFrom`, `fieldRef`, `$(VAR)` expansion), volumes mapped to local folders,
probe settings, restart decisions and the pod phase.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

__all__ = [
    "Probe",
    "build_env",
    "expand_vars",
    "field_ref_value",
    "map_volumes",
    "mount_table",
    "parse_probe",
    "pod_dns_name",
    "pod_phase",
    "restart_backoff_s",
    "rewrite_paths",
    "should_restart",
    "volume_files",
]

Pod = Mapping[str, Any]
Lookup = Callable[[str, str], Mapping[str, str] | None]
"""(namespace, name) -> data of a ConfigMap/Secret (Secret values already decoded), or None."""

PodIP = Callable[[str, str, str], str | None]
"""(namespace, hostname, subdomain) -> the IP of that pod on this node, or None (not running)."""

_LABEL = r"[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
_POD_DNS = re.compile(rf"^({_LABEL})\.({_LABEL})\.({_LABEL})\.svc(?:\.cluster\.local)?$")
_VAR = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_.\-]*)\)")
_LABEL_REF = re.compile(r"^metadata\.(labels|annotations)\['(.+)'\]$")


def expand_vars(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes `$(VAR)` expansion: defined names are replaced, others kept; `$$` is a `$`."""

    def sub(m: re.Match[str]) -> str:
        if m.group(0) == "$$":
            return "$"
        name = m.group(1)
        return env.get(name, m.group(0))

    return _VAR.sub(sub, text)


def pod_dns_name(value: str) -> tuple[str, str, str] | None:
    """(namespace, hostname, subdomain) when `value` is a pod's DNS record under a headless
    Service, `<hostname>.<subdomain>.<namespace>.svc[.cluster.local]` (e.g. a StatefulSet pod's
    `eng-0.eng.ns.svc`), else None."""
    m = _POD_DNS.match(value)
    return None if m is None else (m.group(3), m.group(1), m.group(2))


def field_ref_value(pod: Pod, field_path: str) -> str:
    """The downward-API value of `field_path` (the subset the kubelet supports for env).

    Raises:
        ValueError: for a field path the kubelet would also reject.
    """
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status", {})
    simple = {
        "metadata.name": meta.get("name", ""),
        "metadata.namespace": meta.get("namespace", ""),
        "metadata.uid": meta.get("uid", ""),
        "spec.nodeName": spec.get("nodeName", ""),
        "spec.serviceAccountName": spec.get("serviceAccountName", ""),
        "status.podIP": status.get("podIP", ""),
        "status.hostIP": status.get("hostIP", ""),
        "status.podIPs": ",".join(ip["ip"] for ip in status.get("podIPs", [])),
        "status.hostIPs": ",".join(ip["ip"] for ip in status.get("hostIPs", [])),
    }
    if field_path in simple:
        return str(simple[field_path])
    m = _LABEL_REF.match(field_path)
    if m:
        return str(meta.get(m.group(1), {}).get(m.group(2), ""))
    raise ValueError(f"unsupported fieldRef.fieldPath {field_path!r}; supported: {sorted(simple)}")


def _ref_data(
    ref: Mapping[str, Any], namespace: str, lookup: Lookup, kind: str
) -> Mapping[str, str] | None:
    data = lookup(namespace, ref["name"])
    if data is None and not ref.get("optional", False):
        raise LookupError(f"{kind} {namespace}/{ref['name']} not found")
    return data


def build_env(
    pod: Pod,
    container: Mapping[str, Any],
    *,
    base: Mapping[str, str],
    configmap: Lookup,
    secret: Lookup,
    pod_ip: PodIP | None = None,
) -> dict[str, str]:
    """The environment of `container`: `base`, then `envFrom`, then `env` in order, then POD_IP.

    `pod` must already carry `status.podIP`. Values may reference earlier variables as `$(NAME)`.
    With `pod_ip`, the local node's stand-in for cluster DNS (which it lacks): an `env` value
    that is exactly a pod's DNS record (`pod_dns_name`) becomes that pod's IP.

    Raises:
        LookupError: a referenced ConfigMap/Secret (or key) is missing and not optional.
        ValueError: an unsupported `fieldRef`.
    """
    namespace = pod["metadata"]["namespace"]
    env = dict(base)
    for source in container.get("envFrom", []):
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            data = _ref_data(source["configMapRef"], namespace, configmap, "ConfigMap")
        else:
            data = _ref_data(source["secretRef"], namespace, secret, "Secret")
        env.update({prefix + k: v for k, v in (data or {}).items()})
    for var in container.get("env", []):
        name = var["name"]
        if "value" in var or "valueFrom" not in var:
            env[name] = _resolve_pod_dns(name, expand_vars(var.get("value", ""), env), pod_ip)
            continue
        source = var["valueFrom"]
        if "fieldRef" in source:
            env[name] = field_ref_value(pod, source["fieldRef"]["fieldPath"])
        elif "configMapKeyRef" in source or "secretKeyRef" in source:
            kind = "ConfigMap" if "configMapKeyRef" in source else "Secret"
            ref = source.get("configMapKeyRef") or source["secretKeyRef"]
            data = _ref_data(ref, namespace, configmap if kind == "ConfigMap" else secret, kind)
            if data is not None and ref["key"] in data:
                env[name] = data[ref["key"]]
            elif not ref.get("optional", False):
                raise LookupError(f"key {ref['key']!r} not in {kind} {namespace}/{ref['name']}")
        # NOTE: resourceFieldRef (limits/requests) is not resolved; such variables stay unset.
    env["POD_IP"] = pod.get("status", {}).get("podIP", "")
    return env


def _resolve_pod_dns(name: str, value: str, pod_ip: PodIP | None) -> str:
    record = pod_dns_name(value) if pod_ip is not None else None
    if record is None or pod_ip is None:
        return value
    ip = pod_ip(*record)
    if ip is None:
        raise LookupError(f"{name}: pod {record[1]!r} of {value} has no IP yet")
    return ip


def map_volumes(pod: Pod, pod_dir: Path) -> dict[str, Path]:
    """{volume name: local folder}: hostPath is the path itself; emptyDir, configMap and secret
    volumes get a folder under `pod_dir`. Other types (projected, PVCs, …) have no local folder.
    """
    folders: dict[str, Path] = {}
    for volume in pod.get("spec", {}).get("volumes", []):
        if "hostPath" in volume:
            folders[volume["name"]] = Path(volume["hostPath"]["path"])
        elif "emptyDir" in volume or "configMap" in volume or "secret" in volume:
            folders[volume["name"]] = pod_dir / "volumes" / volume["name"]
    return folders


def volume_files(
    volume: Mapping[str, Any], namespace: str, *, configmap: Lookup, secret: Lookup
) -> dict[str, str]:
    """{relative path: content} of a configMap or secret volume (honouring `items`).

    Raises:
        LookupError: the ConfigMap/Secret (or an item's key) is missing and not optional.
    """
    if "configMap" in volume:
        source, kind, lookup, name = (
            volume["configMap"],
            "ConfigMap",
            configmap,
            volume["configMap"]["name"],
        )
    else:
        source, kind, lookup, name = (
            volume["secret"],
            "Secret",
            secret,
            volume["secret"]["secretName"],
        )
    data = lookup(namespace, name)
    if data is None:
        if source.get("optional", False):
            return {}
        raise LookupError(f"{kind} {namespace}/{name} not found (volume {volume['name']!r})")
    if "items" not in source:
        return dict(data)
    files = {}
    for item in source["items"]:
        if item["key"] in data:
            files[item["path"]] = data[item["key"]]
        elif not source.get("optional", False):
            raise LookupError(f"key {item['key']!r} not in {kind} {namespace}/{name}")
    return files


def mount_table(
    container: Mapping[str, Any], volumes: Mapping[str, Path]
) -> list[tuple[str, Path]]:
    """(mountPath, local folder) for each mapped volumeMount, longest mountPath first."""
    table = []
    for mount in container.get("volumeMounts", []):
        local = volumes.get(mount["name"])
        if local is None:
            continue
        if mount.get("subPath"):
            local = local / mount["subPath"]
        table.append((mount["mountPath"].rstrip("/") or "/", local))
    return sorted(table, key=lambda entry: len(entry[0]), reverse=True)


def rewrite_paths(text: str, mounts: Sequence[tuple[str, Path]]) -> str:
    """Map every path under a volumeMount inside `text` to its local folder.

    Containers can't see mounts here (no mount namespace), so strings naming a mounted path are
    rewritten instead: `/models/x`, `--model=/models/x` and shell strings such as
    `cat /etc/cfg/a > /work/out`. A mount path matches only as a whole path (not `/models2`,
    not `/a/models`); the longest mount wins. Anything else is returned unchanged.
    """
    if not mounts:
        return text
    local_of = dict(mounts)
    # Longest first, so /models/cache beats /models; a match must start a path and end one.
    alternatives = "|".join(re.escape(m) for m, _ in sorted(mounts, key=lambda e: -len(e[0])))
    pattern = re.compile(rf"(?<![\w./-])({alternatives})(?=/|$|[\s'\":;,)])")
    return pattern.sub(lambda m: str(local_of[m.group(1)]), text)


@dataclass(frozen=True, slots=True)
class Probe:
    """A readiness or liveness probe, with the Kubernetes defaults filled in."""

    kind: str
    """'http', 'tcp' or 'exec'."""
    port: int = 0
    path: str = "/"
    scheme: str = "HTTP"
    command: tuple[str, ...] = ()
    initial_delay_s: float = 0.0
    period_s: float = 10.0
    timeout_s: float = 1.0
    success_threshold: int = 1
    failure_threshold: int = 3


def _resolve_port(port: int | str, container: Mapping[str, Any]) -> int:
    if isinstance(port, int) or str(port).isdigit():
        return int(port)
    for p in container.get("ports", []):
        if p.get("name") == port:
            return int(p["containerPort"])
    raise ValueError(
        f"probe port {port!r} is not a named port of container {container.get('name')!r}"
    )


def parse_probe(probe: Mapping[str, Any] | None, container: Mapping[str, Any]) -> Probe | None:
    """Parse a probe object; None when absent. gRPC probes raise ValueError (unsupported)."""
    if not probe:
        return None
    timing = Probe(
        kind="",
        initial_delay_s=float(probe.get("initialDelaySeconds", 0)),
        period_s=float(probe.get("periodSeconds", 10)),
        timeout_s=float(probe.get("timeoutSeconds", 1)),
        success_threshold=int(probe.get("successThreshold", 1)),
        failure_threshold=int(probe.get("failureThreshold", 3)),
    )
    if "httpGet" in probe:
        get = probe["httpGet"]
        port = _resolve_port(get["port"], container)
        path, scheme = get.get("path", "/"), get.get("scheme", "HTTP")
        return replace(timing, kind="http", port=port, path=path, scheme=scheme)
    if "tcpSocket" in probe:
        return replace(
            timing, kind="tcp", port=_resolve_port(probe["tcpSocket"]["port"], container)
        )
    if "exec" in probe:
        return replace(timing, kind="exec", command=tuple(probe["exec"].get("command", [])))
    raise ValueError(f"unsupported probe {sorted(probe)}; supported: httpGet, tcpSocket, exec")


def should_restart(restart_policy: str, exit_code: int) -> bool:
    """The kubelet's rule: Always restarts, OnFailure on a non-zero exit, Never never."""
    if restart_policy == "Always":
        return True
    if restart_policy == "OnFailure":
        return exit_code != 0
    return False


def restart_backoff_s(restart_count: int, *, cap_s: float = 5.0) -> float:
    """Delay before restart number `restart_count + 1`: 0.5 s doubling, capped small for tests.

    (The kubelet starts at 10 s and caps at 5 min; a dev cluster wants fast feedback.)
    """
    return min(0.5 * 2 ** min(restart_count, 10), cap_s)


def pod_phase(states: Sequence[str], exit_codes: Sequence[int | None], restarting: bool) -> str:
    """Pod phase from container states ('waiting' | 'running' | 'terminated').

    Running while any container runs or will be restarted; Succeeded when all terminated with 0;
    Failed when all terminated and one failed; Pending before anything started.
    """
    if any(s == "running" for s in states) or restarting:
        return "Running"
    if states and all(s == "terminated" for s in states):
        return "Succeeded" if all(code == 0 for code in exit_codes) else "Failed"
    return "Pending"
