"""The local node agent: a tiny kubelet that runs pods bound to its Node as local processes.

Run by `fleetserve dev-cluster up` as
`python -m fleetserve.devcluster.local_node --kubeconfig K --state-dir D --logs-dir L`.

Lifecycle:
  1. Register the Node (cpu/memory of this machine; label and NoSchedule taint
     `fleetserve.io/local-node=true`, so only pods that tolerate it land here).
  2. Loop: a watch on pods bound to the node wakes the loop early; every pass lists those pods
     (level-based) and
     - starts new pods: a loopback IP 127.0.0.N (N from 10; the prefix is configurable) as podIP
       and POD_IP, env, volumes,
       a per-pod KUBECONFIG holding a TokenRequest token of the pod's ServiceAccount;
     - ticks containers (exits, restarts per restartPolicy with a small backoff, probes);
     - on deletionTimestamp: SIGTERM the process groups, SIGKILL after the grace period, then
       deletes the pod with grace 0 so the API object goes away, and frees the IP;
     - writes each pod's status when it changed; renews the node Lease and Ready condition.
  3. On SIGTERM/SIGINT: stop every pod's processes and exit.
The live process groups are mirrored in `<state-dir>/pods.json` for `down`.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import json
import logging
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kubernetes import client, watch
from kubernetes.client.rest import ApiException

from fleetserve.devcluster import kube, node_heartbeat
from fleetserve.devcluster.binaries import K8S_VERSION
from fleetserve.devcluster.ip_pool import IpPool
from fleetserve.devcluster.nodes import build_local_node
from fleetserve.devcluster.pki import write_kubeconfig
from fleetserve.devcluster.pod_launch import build_launch
from fleetserve.devcluster.pod_records import save_pod_records
from fleetserve.devcluster.pod_runtime import PodRuntime
from fleetserve.devcluster.podspec import Lookup, PodIP

__all__ = ["AgentConfig", "LocalNodeAgent", "main"]

log = logging.getLogger("fleetserve.devcluster.local_node")

_API_TIMEOUT_S = 10.0
"""Per API call: a dying apiserver must not block the loop (and with it, stopping pods)."""


@dataclass(frozen=True, slots=True)
class AgentConfig:
    kubeconfig: Path
    state_dir: Path
    """Pod folders (emptyDirs, per-pod kubeconfigs) and pods.json."""
    logs_dir: Path
    """Container logs, `<namespace>_<pod>_<container>.log`."""
    node_name: str = "fleetserve-local"
    heartbeat_s: float = 10.0
    """Lease renewal and Ready-condition period (the node monitor grace period is 40-50 s)."""
    resync_s: float = 1.0
    """Longest time between two pod listings when no watch event arrives."""
    tick_s: float = 0.2
    """Loop period: how fast exits, probe results and restarts reach the API."""
    cpus: int | None = None
    """Advertised CPU capacity; None: this machine's (os.cpu_count()). Processes are not limited."""
    memory_bytes: int | None = None
    """Advertised memory capacity; None: this machine's (MemTotal)."""
    gpus: int = 0
    """Advertised `nvidia.com/gpu` capacity (fake: pods run on the CPU)."""
    ip_prefix: str = "127.0.0"
    """Pod IPs are {ip_prefix}.10, .11, …; clusters running side by side need different prefixes."""


def _base_env() -> dict[str, str]:
    """The agent's own environment minus the admin credentials, with this Python's bin first.

    So `python`, `fleetserve`, `kopf` in a pod's command resolve to the venv the cluster was
    started from, even when that venv is not activated.
    """
    env = {k: v for k, v in os.environ.items() if k != "KUBECONFIG"}
    env["PATH"] = os.pathsep.join(
        [str(Path(sys.executable).parent), env.get("PATH", "/usr/bin:/bin")]
    )
    return env


class LocalNodeAgent:
    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.api = kube.api_client(cfg.kubeconfig)
        self.core = client.CoreV1Api(self.api)
        self.ips = IpPool(cfg.ip_prefix)
        self.pods: dict[str, PodRuntime] = {}
        self.names: dict[str, tuple[str, str]] = {}
        """uid -> (namespace, name) of every pod in `pods`."""
        self.pushed: dict[str, dict[str, Any]] = {}
        self.retry_at: dict[str, float] = {}
        """uid -> when to retry a pod whose containers could not be built (missing ConfigMap…)."""
        self.wake = threading.Event()
        self._records: list[Any] = []

    # --- node -------------------------------------------------------------------------------
    def register_node(self) -> None:
        meminfo = Path("/proc/meminfo").read_text().split("\n", 1)[0]  # "MemTotal: N kB"
        body = build_local_node(
            self.cfg.node_name,
            cpus=self.cfg.cpus or os.cpu_count() or 1,
            memory_bytes=self.cfg.memory_bytes or int(meminfo.split()[1]) * 1024,
            gpus=self.cfg.gpus,
            kubelet_version=K8S_VERSION,
        )
        node_heartbeat.register_node(self.api, body, timeout_s=_API_TIMEOUT_S)

    def heartbeat(self) -> None:
        node_heartbeat.renew(self.api, self.cfg.node_name, timeout_s=_API_TIMEOUT_S)

    # --- pods -------------------------------------------------------------------------------
    def _list_pods(self) -> list[dict[str, Any]]:
        resp = self.core.list_pod_for_all_namespaces(
            field_selector=f"spec.nodeName={self.cfg.node_name}",
            _preload_content=False,
            _request_timeout=_API_TIMEOUT_S,
        )
        return list(json.loads(resp.data)["items"])  # type: ignore[attr-defined]  # raw response

    def _lookup(self, kind: str) -> Lookup:
        def lookup(namespace: str, name: str) -> Mapping[str, str] | None:
            try:
                if kind == "configmap":
                    return (
                        self.core.read_namespaced_config_map(
                            name, namespace, _request_timeout=_API_TIMEOUT_S
                        ).data
                        or {}
                    )
                data = (
                    self.core.read_namespaced_secret(
                        name, namespace, _request_timeout=_API_TIMEOUT_S
                    ).data
                    or {}
                )
                return {k: base64.b64decode(v).decode() for k, v in data.items()}
            except ApiException as e:
                if e.status == 404:
                    return None
                raise

        return lookup

    def _pod_ip_lookup(self, starting: Mapping[str, Any]) -> PodIP:
        """Pod DNS records of this node's running pods (and of the pod being started) → IPs:
        what cluster DNS would answer for `<hostname>.<subdomain>.<namespace>.svc`."""

        def lookup(namespace: str, hostname: str, subdomain: str) -> str | None:
            meta, spec = starting["metadata"], starting["spec"]
            if (namespace, hostname, subdomain) == (
                meta["namespace"], spec.get("hostname", meta["name"]), spec.get("subdomain"),
            ):  # fmt: skip
                return str(starting["status"]["podIP"])
            for uid, (ns, name) in self.names.items():
                if (ns, name) == (namespace, hostname) and not self.pods[uid].is_terminating:
                    return self.pods[uid].ip
            return None

        return lookup

    def _pod_kubeconfig(self, pod: dict[str, Any], pod_dir: Path) -> Path | None:
        """A kubeconfig with a pod-bound token of the pod's ServiceAccount (as the kubelet mounts)."""
        spec, meta = pod["spec"], pod["metadata"]
        if spec.get("automountServiceAccountToken") is False:
            return None
        request = client.AuthenticationV1TokenRequest(
            spec=client.V1TokenRequestSpec(
                audiences=[], expiration_seconds=86400,
                bound_object_ref=client.V1BoundObjectReference(kind="Pod", api_version="v1", name=meta["name"], uid=meta["uid"]),
            )
        )  # fmt: skip
        sa = spec.get("serviceAccountName") or "default"
        try:
            token = kube.service_account_token(self.api, sa, meta["namespace"], request=request)
        except ApiException as e:
            log.warning("no token for %s/%s: %s", meta["namespace"], sa, e.reason)
            return None
        conf = self.api.configuration
        path = pod_dir / "kubeconfig"
        write_kubeconfig(
            path, server=conf.host, ca_crt=Path(conf.ssl_ca_cert), token=token, user=sa
        )
        return path

    def _start_pod(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        uid = meta["uid"]
        pod_dir = self.cfg.state_dir / "pods" / uid
        pod_dir.mkdir(parents=True, exist_ok=True)
        # hostNetwork pods share the node's address, as under a kubelet.
        ip = "127.0.0.1" if pod["spec"].get("hostNetwork") else self.ips.allocate()
        pod.setdefault("status", {})["podIP"] = ip
        pod["status"]["podIPs"] = [{"ip": ip}]
        pod["status"]["hostIP"] = "127.0.0.1"
        try:
            env = _base_env() | {"HOSTNAME": meta["name"]}
            kubeconfig = self._pod_kubeconfig(pod, pod_dir)
            if kubeconfig is not None:
                env["KUBECONFIG"] = str(kubeconfig)
            launch = build_launch(
                pod, pod_dir=pod_dir, logs_dir=self.cfg.logs_dir, base_env=env,
                configmap=self._lookup("configmap"), secret=self._lookup("secret"),
                pod_ip=self._pod_ip_lookup(pod),
            )  # fmt: skip
        except (ValueError, LookupError) as e:
            self.ips.release(ip)
            self.retry_at[uid] = time.monotonic() + 2.0
            self._patch_status(meta, uid, _config_error_status(pod, str(e)))
            return
        self.retry_at.pop(uid, None)
        runtime = PodRuntime(uid, ip, launch, pod["spec"].get("restartPolicy", "Always"))
        self.pods[uid] = runtime
        self.names[uid] = (meta["namespace"], meta["name"])
        runtime.tick(time.monotonic())
        log.info("started pod %s/%s on %s", meta["namespace"], meta["name"], ip)

    def _forget(self, uid: str) -> None:
        runtime = self.pods.pop(uid)
        self.ips.release(runtime.ip)
        self.names.pop(uid, None)
        self.pushed.pop(uid, None)
        shutil.rmtree(self.cfg.state_dir / "pods" / uid, ignore_errors=True)

    def _patch_status(self, meta: Mapping[str, Any], uid: str, status: dict[str, Any]) -> None:
        if self.pushed.get(uid) == status:
            return
        try:
            self.core.patch_namespaced_pod_status(
                meta["name"], meta["namespace"], {"status": status}, _request_timeout=_API_TIMEOUT_S
            )
            self.pushed[uid] = status
        except ApiException as e:
            if e.status != 404:
                log.warning(
                    "status of %s/%s: %s %s", meta["namespace"], meta["name"], e.status, e.body
                )

    def reconcile(self) -> None:
        """Level-based pass over every pod bound to this node."""
        now = time.monotonic()
        seen = set()
        for pod in self._list_pods():
            meta = pod["metadata"]
            uid = meta["uid"]
            seen.add(uid)
            runtime = self.pods.get(uid)
            if runtime is None:
                if meta.get("deletionTimestamp"):
                    self._delete_now(meta)
                elif pod.get("status", {}).get("phase") not in ("Succeeded", "Failed") and (
                    now >= self.retry_at.get(uid, 0.0)
                ):
                    self._start_pod(pod)
                continue
            if meta.get("deletionTimestamp") and not runtime.is_terminating:
                grace = meta.get("deletionGracePeriodSeconds")
                if grace is None:
                    grace = pod["spec"].get("terminationGracePeriodSeconds", 30)
                runtime.terminate(float(grace))
        for uid in list(self.pods):
            if uid not in seen:  # force-deleted or gone: nothing to report to
                self.pods[uid].terminate(0.0)
                self.pods[uid].tick(now)
                if self.pods[uid].is_stopped:
                    self._forget(uid)
        self.retry_at = {uid: t for uid, t in self.retry_at.items() if uid in seen}

    def _delete_now(self, meta: Mapping[str, Any]) -> None:
        with contextlib.suppress(ApiException):
            self.core.delete_namespaced_pod(
                meta["name"], meta["namespace"], _request_timeout=_API_TIMEOUT_S, grace_period_seconds=0,
                body=client.V1DeleteOptions(grace_period_seconds=0, preconditions=client.V1Preconditions(uid=meta["uid"])),
            )  # fmt: skip

    def tick(self) -> None:
        """Advance every pod's containers and push changed statuses; finish deletions."""
        now = time.monotonic()
        for uid, runtime in list(self.pods.items()):
            runtime.tick(now)
            namespace, name = self.names[uid]
            meta = {"name": name, "namespace": namespace, "uid": uid}
            if runtime.is_terminating:
                if runtime.is_stopped:
                    self._delete_now(meta)
                    self._forget(uid)
                    log.info("deleted pod %s/%s", namespace, name)
                continue
            self._patch_status(meta, uid, runtime.status())
        records = [r for runtime in self.pods.values() for r in runtime.records()]
        if records != self._records:
            save_pod_records(self.cfg.state_dir, records)
            self._records = records

    def _watch(self, stop: threading.Event) -> None:
        api = kube.api_client(self.cfg.kubeconfig)
        core = client.CoreV1Api(api)
        while not stop.is_set():
            try:
                for _ in watch.Watch().stream(
                    core.list_pod_for_all_namespaces, field_selector=f"spec.nodeName={self.cfg.node_name}",
                    timeout_seconds=30, _request_timeout=40,
                ):  # fmt: skip
                    self.wake.set()
                    if stop.is_set():
                        return
            except Exception as e:
                log.debug("pod watch restarts: %s", e)
                stop.wait(0.5)

    def run(self, stop: threading.Event) -> None:
        self.register_node()
        threading.Thread(target=self._watch, args=(stop,), daemon=True).start()
        last_list = last_beat = 0.0
        while not stop.is_set():
            now = time.monotonic()
            try:
                if self.wake.is_set() or now - last_list >= self.cfg.resync_s:
                    self.wake.clear()
                    last_list = now
                    self.reconcile()
                self.tick()
                if now - last_beat >= self.cfg.heartbeat_s:
                    last_beat = now
                    self.heartbeat()
            except (ApiException, OSError) as e:  # apiserver restarting: retry on the next pass
                log.warning("loop: %s", e)
            except Exception:  # a bug must not take every local pod down with the agent
                log.exception("agent loop failed; continuing")
            self.wake.wait(self.cfg.tick_s)
        self.shutdown()

    def shutdown(self, grace_s: float = 5.0) -> None:
        """Stop every pod's processes (SIGTERM, SIGKILL after `grace_s`)."""
        for runtime in self.pods.values():
            runtime.terminate(grace_s)
        deadline = time.monotonic() + grace_s + 2.0
        while time.monotonic() < deadline and not all(r.is_stopped for r in self.pods.values()):
            for runtime in self.pods.values():
                runtime.tick(time.monotonic())
            time.sleep(0.05)
        save_pod_records(self.cfg.state_dir, [r for rt in self.pods.values() for r in rt.records()])


def _config_error_status(pod: Mapping[str, Any], message: str) -> dict[str, Any]:
    waiting = {"waiting": {"reason": "CreateContainerConfigError", "message": message}}
    return {
        "phase": "Pending",
        "hostIP": "127.0.0.1",
        "containerStatuses": [
            {
                "name": c["name"],
                "image": c.get("image", ""),
                "imageID": "",
                "ready": False,
                "restartCount": 0,
                "state": waiting,
            }
            for c in pod["spec"]["containers"]
        ],
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m fleetserve.devcluster.local_node", description=__doc__.split("\n")[0]
    )
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--state-dir", type=Path, required=True)
    parser.add_argument("--logs-dir", type=Path, required=True)
    parser.add_argument("--node-name", default="fleetserve-local")
    parser.add_argument("--ip-prefix", default="127.0.0", help="pod IPs: <prefix>.10, .11, …")
    parser.add_argument("--cpus", type=int, default=None, help="advertised CPUs (default: real)")
    parser.add_argument("--memory-bytes", type=int, default=None, help="advertised memory")
    parser.add_argument("--gpus", type=int, default=0, help="advertised nvidia.com/gpu")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    cfg = AgentConfig(
        kubeconfig=args.kubeconfig,
        state_dir=args.state_dir,
        logs_dir=args.logs_dir,
        node_name=args.node_name,
        ip_prefix=args.ip_prefix,
        cpus=args.cpus,
        memory_bytes=args.memory_bytes,
        gpus=args.gpus,
    )
    agent = LocalNodeAgent(cfg)
    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        stop.set()
        agent.wake.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    agent.run(stop)


if __name__ == "__main__":
    main()
