"""Bring a dev cluster up and down: etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
kwok (fake GPU and CPU nodes) and the local node agent, all as processes bound to 127.0.0.1.

Lifecycle of `up`:
  1. PKI and the admin kubeconfig in `<dir>`; free loopback ports chosen by the kernel.
  2. etcd, waited for on /health; kube-apiserver, waited for on /readyz.
  3. kube-controller-manager, kube-scheduler, kwok and the local node agent, started together.
  4. The fake nodes are created; `up` returns once every node is Ready and the `default`
     ServiceAccount exists (pods are rejected before that).
  5. With `kueue`, Kueue and its default queues (`fleetserve.devcluster.kueue`).
Every started process is recorded in `<dir>/state.json` at once, so `down` can always clean up;
a failing `up` runs `down` itself.
"""

from __future__ import annotations

import os
import shutil
import signal
import ssl
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import fleetserve
from fleetserve.common.ports import free_ports
from fleetserve.devcluster import kube
from fleetserve.devcluster.binaries import Binaries, find_binaries
from fleetserve.devcluster.kueue import start_kueue
from fleetserve.devcluster.nodes import NodeTopology, build_fake_nodes
from fleetserve.devcluster.pki import Pki, create_pki, write_kubeconfig
from fleetserve.devcluster.pod_records import kill_recorded_pods
from fleetserve.devcluster.processes import (
    is_port_open,
    spawn,
    stop,
    wait_for,
    wait_http_ok,
)
from fleetserve.devcluster.state import ClusterState, load_state, save_state

__all__ = ["LOCAL_NODE_NAME", "ClusterConfig", "down", "pod_ip_prefix", "up"]

LOCAL_NODE_NAME = "fleetserve-local"
SERVICE_CIDR = "10.0.0.0/24"
KWOK_POD_CIDR = "10.244.0.0/16"
"""Pod IPs kwok hands out. Not loopback: EndpointSlice validation rejects 127.0.0.0/8."""

AUDIT_POLICY = """\
apiVersion: audit.k8s.io/v1
kind: Policy
# Only ServiceAccount callers (operators under test); system components use the admin cert.
omitStages: [RequestReceived]
rules:
- level: Metadata
  userGroups: ["system:serviceaccounts"]
- level: None
"""


@dataclass(frozen=True, slots=True)
class ClusterConfig:
    """What `fleetserve dev-cluster up` was asked for."""

    dir: Path
    """State folder: PKI, kubeconfig, etcd data, logs, state.json. Removed by `down`."""
    topology: NodeTopology = field(default_factory=NodeTopology)
    local_node: bool = True
    """Also run the local node agent (pods on it run as local processes)."""
    bin_dir: Path | None = None
    """Override the binaries' cache folder (default: binaries.default_bin_dir())."""
    timeout_s: float = 120.0
    """Upper bound for each wait of `up`; a healthy start takes well under a minute."""
    die_with_caller: bool = False
    """Tie every process to the calling thread (tests); the CLI's cluster outlives `up`."""
    local_node_cpus: int | None = None
    """CPU capacity the local node advertises (None: this machine's). Raise it when the pods you
    point at the local node request more CPU than the machine has; processes are not limited."""
    local_node_memory_gib: int | None = None
    """Memory capacity the local node advertises (None: this machine's)."""
    local_node_gpus: int = 0
    """`nvidia.com/gpu` the local node advertises, so GPU-requesting pods can run here on the CPU."""
    unique_pod_ips: bool = False
    """Local pods get 127.<p // 256>.<p % 256>.N (p: the apiserver port) instead of 127.0.0.N,
    so test clusters running beside each other (or beside `up`'s) never share a pod address."""
    kueue: bool = False
    """Also run Kueue (gang admission of pod groups) with default queues sized from the nodes
    (`fleetserve.devcluster.kueue`)."""


def _etcd_argv(b: Binaries, d: Path, client_port: int, peer_port: int) -> list[str | Path]:
    client_url, peer_url = f"http://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    return [
        b.etcd, "--name=dev", f"--data-dir={d / 'etcd'}",
        # A throwaway cluster: skip fsync, which dominates etcd latency on shared disks.
        "--unsafe-no-fsync",
        f"--listen-client-urls={client_url}", f"--advertise-client-urls={client_url}",
        f"--listen-peer-urls={peer_url}", f"--initial-advertise-peer-urls={peer_url}",
        f"--initial-cluster=dev={peer_url}", "--log-level=warn",
    ]  # fmt: skip


def _apiserver_argv(b: Binaries, d: Path, pki: Pki, etcd_port: int, port: int) -> list[str | Path]:
    (d / "audit-policy.yaml").write_text(AUDIT_POLICY)
    return [
        b.kube_apiserver,
        f"--etcd-servers=http://127.0.0.1:{etcd_port}",
        "--bind-address=127.0.0.1", f"--secure-port={port}",
        f"--tls-cert-file={pki.apiserver_crt}", f"--tls-private-key-file={pki.apiserver_key}",
        f"--client-ca-file={pki.ca_crt}",
        "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
        f"--service-account-key-file={pki.sa_pub}",
        f"--service-account-signing-key-file={pki.sa_key}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        # Node authorizer as in production; RBAC is what the operator's tests prove.
        "--authorization-mode=Node,RBAC",
        "--allow-privileged=true",
        f"--audit-policy-file={d / 'audit-policy.yaml'}", f"--audit-log-path={d / 'logs' / 'audit.log'}",
        # A long local session must not fill the disk: rotate at 100 MB, keep one old file.
        "--audit-log-maxsize=100", "--audit-log-maxbackup=1",
        "--profiling=false",
    ]  # fmt: skip


def _kcm_argv(b: Binaries, d: Path, pki: Pki) -> list[str | Path]:
    return [
        b.kube_controller_manager,
        f"--kubeconfig={d / 'admin.kubeconfig'}",
        # Nothing queries its HTTPS endpoint; port 0 serves nothing and needs no certificate.
        "--secure-port=0",
        "--leader-elect=false",
        f"--root-ca-file={pki.ca_crt}",
        f"--service-account-private-key-file={pki.sa_key}",
        "--cluster-name=dev-cluster",
        "--controllers=*",
    ]


def _scheduler_argv(b: Binaries, d: Path) -> list[str | Path]:
    return [
        b.kube_scheduler,
        f"--kubeconfig={d / 'admin.kubeconfig'}",
        "--secure-port=0",
        "--leader-elect=false",
    ]


def _kwok_argv(b: Binaries, d: Path, port: int) -> list[str | Path]:
    return [
        b.kwok, f"--kubeconfig={d / 'admin.kubeconfig'}", f"--config={b.kwok_stages}",
        # Only the annotated fake nodes: the local node belongs to our own agent.
        "--manage-all-nodes=false",
        "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
        f"--cidr={KWOK_POD_CIDR}", "--node-ip=127.0.0.1", "--node-lease-duration-seconds=40",
        # Without --server-address kwok binds its kubelet-like server on 0.0.0.0.
        f"--server-address=127.0.0.1:{port}", f"--node-port={port}",
    ]  # fmt: skip


def pod_ip_prefix(cfg: ClusterConfig, apiserver_port: int) -> str:
    """First three octets of the local node's pod IPs (see ClusterConfig.unique_pod_ips)."""
    if not cfg.unique_pod_ips:
        return "127.0.0"
    return f"127.{apiserver_port // 256}.{apiserver_port % 256}"


def _local_node_argv(cfg: ClusterConfig, state: ClusterState, ip_prefix: str) -> list[str | Path]:
    argv: list[str | Path] = [
        sys.executable, "-m", "fleetserve.devcluster.local_node",
        f"--kubeconfig={state.kubeconfig}", f"--state-dir={state.local_node_dir}",
        f"--logs-dir={state.logs_dir / 'pods'}", f"--node-name={LOCAL_NODE_NAME}",
        f"--ip-prefix={ip_prefix}", f"--gpus={cfg.local_node_gpus}",
    ]  # fmt: skip
    if cfg.local_node_cpus is not None:
        argv.append(f"--cpus={cfg.local_node_cpus}")
    if cfg.local_node_memory_gib is not None:
        argv.append(f"--memory-bytes={cfg.local_node_memory_gib * 1024**3}")
    return argv


def _agent_env() -> dict[str, str]:
    # The agent runs `-m fleetserve.devcluster.local_node` from the state folder: make this very
    # fleetserve importable there even when it is not installed into the interpreter.
    env = dict(os.environ)
    source_root = str(Path(fleetserve.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (source_root, env.get("PYTHONPATH")) if p)
    return env


def _start(
    state: ClusterState,
    name: str,
    argv: list[str | Path],
    *,
    cfg: ClusterConfig,
    env: dict[str, str] | None = None,
) -> ClusterState:
    log = state.logs_dir / f"{name}.log"
    # Orphaned by a killed test run: the agent gets SIGTERM to stop its pods; the control plane
    # is SIGKILLed, since kube-apiserver's graceful shutdown hangs for minutes once etcd is gone.
    sig = signal.SIGTERM if name == "local-node" else signal.SIGKILL
    record = spawn(
        name,
        argv,
        log=log,
        cwd=state.dir,
        env=env,
        die_with_parent=sig if cfg.die_with_caller else None,
    )
    state = state.with_process(record)
    save_state(state)
    return state


def up(cfg: ClusterConfig, *, log: bool = True) -> ClusterState:
    """Start a cluster in `cfg.dir` and return once it is usable; see the module docstring.

    Raises:
        FileExistsError: a cluster recorded in `cfg.dir` still runs.
        FileNotFoundError: the binaries are not built.
        TimeoutError / RuntimeError: a component did not come up (the cluster is torn down).
    """
    binaries = find_binaries(cfg.bin_dir)
    if cfg.kueue:
        binaries.require_kueue()
    d = cfg.dir.resolve()
    previous = load_state(d)
    if previous is not None:
        if any(p.is_alive() for p in previous.processes):
            raise FileExistsError(f"a dev cluster is already running in {d}; run `down` first")
        down(d)
    d.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()

    def say(msg: str) -> None:
        if log:
            print(f"[dev-cluster {time.monotonic() - t0:5.1f}s] {msg}", file=sys.stderr, flush=True)

    ports = dict(zip(("etcd", "etcd-peer", "apiserver", "kwok"), free_ports(4), strict=True))
    state = ClusterState(
        dir=d,
        server=f"https://127.0.0.1:{ports['apiserver']}",
        ports=ports,
        local_node=LOCAL_NODE_NAME if cfg.local_node else None,
    )
    state.logs_dir.mkdir(parents=True, exist_ok=True)
    save_state(state)
    try:
        pki = create_pki(state.pki_dir)
        write_kubeconfig(
            state.kubeconfig, server=state.server, ca_crt=pki.ca_crt,
            client_crt=pki.admin_crt, client_key=pki.admin_key,
        )  # fmt: skip
        state = _start(
            state, "etcd", _etcd_argv(binaries, d, ports["etcd"], ports["etcd-peer"]), cfg=cfg
        )
        wait_http_ok(
            f"http://127.0.0.1:{ports['etcd']}/health",
            timeout_s=cfg.timeout_s,
            alive=state.processes[-1],
        )
        say("etcd healthy")
        apiserver = _apiserver_argv(binaries, d, pki, ports["etcd"], ports["apiserver"])
        state = _start(state, "kube-apiserver", apiserver, cfg=cfg)
        tls = ssl.create_default_context(cafile=str(pki.ca_crt))
        tls.load_cert_chain(str(pki.admin_crt), str(pki.admin_key))
        wait_http_ok(
            f"{state.server}/readyz",
            timeout_s=cfg.timeout_s,
            ssl_context=tls,
            alive=state.processes[-1],
        )
        say(f"kube-apiserver ready at {state.server}")
        state = _start(state, "kube-controller-manager", _kcm_argv(binaries, d, pki), cfg=cfg)
        state = _start(state, "kube-scheduler", _scheduler_argv(binaries, d), cfg=cfg)
        state = _start(state, "kwok", _kwok_argv(binaries, d, ports["kwok"]), cfg=cfg)
        if cfg.local_node:
            state = _start(
                state,
                "local-node",
                _local_node_argv(cfg, state, pod_ip_prefix(cfg, ports["apiserver"])),
                env=_agent_env(),
                cfg=cfg,
            )
        fake_nodes = build_fake_nodes(cfg.topology)
        with kube.api_client(state.kubeconfig) as api:
            kube.create_nodes(api, fake_nodes)
            names = [n["metadata"]["name"] for n in fake_nodes]
            if state.local_node:
                names.append(state.local_node)
            kube.wait_nodes_ready(api, names, timeout_s=cfg.timeout_s, alive=state.processes)
            say(f"{len(names)} nodes Ready")
            kube.wait_default_service_account(api, timeout_s=cfg.timeout_s, alive=state.processes)
        if cfg.kueue:
            state = start_kueue(
                state, binaries, die_with_caller=cfg.die_with_caller, timeout_s=cfg.timeout_s
            )
            say("kueue ready (LocalQueue fleetserve in namespace default)")
        dead = [p.name for p in state.processes if not p.is_alive()]
        if dead:
            raise RuntimeError(f"exited during start: {dead}; see {state.logs_dir}")
        say("cluster up")
        return state
    except BaseException:
        say(f"start failed; logs kept in {d / 'logs'} until down; tearing down processes")
        down(d, remove=False)
        raise


def down(dir: Path, *, remove: bool = True, port_timeout_s: float = 10.0) -> list[str]:
    """Stop every process the cluster in `dir` started, local pods included; remove `dir`.

    Returns the names of the processes that were still running. Raises RuntimeError when a
    port of the cluster is still open afterwards (the state folder is then kept).
    """
    d = dir.resolve()
    state = load_state(d)
    if state is None:
        if remove and d.exists() and (d / "pki").exists():
            shutil.rmtree(d)
        return []
    stopped = []
    for record in reversed(state.processes):
        if record.is_alive():
            stopped.append(record.name)
        stop(record)
    # The agent stops its pods on SIGTERM; these are the ones it could not (it was killed).
    kill_recorded_pods(state.local_node_dir)
    open_ports: list[int] = []

    def ports_closed() -> bool:
        open_ports[:] = [p for p in state.ports.values() if is_port_open(p)]
        return not open_ports

    try:
        wait_for("ports to close", ports_closed, timeout_s=port_timeout_s)
    except TimeoutError as e:
        raise RuntimeError(f"ports still open after down: {open_ports}") from e
    if remove:
        shutil.rmtree(d)
    return stopped
