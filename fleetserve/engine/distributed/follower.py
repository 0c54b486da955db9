"""A follower pod of a multi-pod replica group: this pod's worker processes, nothing else.

`fleetserve serve` runs this instead of the API server on every pod but the leader (pod 0) of a
group (`pod_group`). It starts one `worker_proc` per local rank, connected to the leader's
control sockets and rendezvous, and then watches them and the leader:

- a worker that exits with an error ends the pod (exit 1): a group's ranks never restart alone,
  the operator recreates the whole group;
- every worker exiting cleanly means the leader stopped the group (exit 0);
- the leader must answer at its control port within `LEADER_WAIT_S` of the start, and once it
  did, a leader silent for `LEADER_LOST_S` (probed every `PROBE_S`) ends the pod (exit 1) with a
  message that says so, instead of workers waiting for calls that never come.

`GET /health` at the pod's serving address answers 200 while every worker lives and the leader
answers, else 503, so the pod's readiness probe means the same as on the leader.
"""

from __future__ import annotations

import logging
import pickle
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import FrameType
from typing import Any

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.distributed.parallel_state import layout_of
from fleetserve.engine.distributed.pod_group import CONTROL_PORT, PodGroup
from fleetserve.engine.worker.multiproc_executor import worker_argv

__all__ = ["LEADER_LOST_S", "LEADER_WAIT_S", "PROBE_S", "run_follower"]

logger = logging.getLogger(__name__)

LEADER_WAIT_S = 600.0
"""Bound on the leader's first answer (it loads the model and starts its own ranks meanwhile)."""
LEADER_LOST_S = 5.0
"""A leader that answered once and then stays silent this long is gone."""
PROBE_S = 1.0
"""Period of the leader probe and of the workers' liveness check."""


class _Health:
    """The follower's health, read by the HTTP handler thread."""

    def __init__(self) -> None:
        self.ok = False
        self.reason = "starting"


def _health_server(host: str, port: int, health: _Health) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path != "/health":
                self.send_error(404)
                return
            body = (health.reason + "\n").encode()
            self.send_response(200 if health.ok else 503)
            self.send_header("Content-Type", "text/plain")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: Any) -> None:
            return  # NOTE: probes every few seconds; nothing worth a log line

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="follower-health", daemon=True).start()
    return server


def _leader_answers(group: PodGroup, timeout_s: float) -> bool:
    try:
        with socket.create_connection((group.leader_address, CONTROL_PORT), timeout=timeout_s):
            return True
    except OSError:
        return False


def run_follower(config: EngineConfig, group: PodGroup, *, host: str, port: int) -> int:
    """Run this pod's ranks until the group ends; the exit code (see the module docstring).

    Raises:
        ValueError: `group` is the leader's (the leader serves; see `MultiprocExecutor`).
    """
    if group.is_leader:
        raise ValueError("pod 0 of a group leads (it serves and drives); it runs no follower")
    workdir = tempfile.mkdtemp(prefix="fleetserve-follower-")
    config_path = f"{workdir}/config.pkl"
    with open(config_path, "wb") as f:
        pickle.dump(config, f, protocol=5)
    driver_rank = layout_of(config.parallel).pipeline[0][-1]
    health = _Health()
    server = _health_server(host, port, health)
    procs: dict[int, subprocess.Popen[bytes]] = {}

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(0)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        for rank in group.local_ranks:
            argv = worker_argv(
                rank=rank,
                driver_rank=driver_rank,
                config_path=config_path,
                requests=group.requests_endpoint(rank),
                results=group.results_endpoint,
                init_method=group.init_method,
            )
            procs[rank] = subprocess.Popen(argv)
        logger.info(
            "pod %d of %d: ranks %s joining the leader at %s; health at http://%s:%d/health",
            group.pod_index, group.num_pods, list(group.local_ranks), group.init_method, host,
            port,
        )  # fmt: skip
        return _watch(procs, group, health)
    finally:
        signal.signal(signal.SIGTERM, previous)
        health.ok, health.reason = False, "stopping"
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait()
        server.shutdown()
        server.server_close()
        shutil.rmtree(workdir, ignore_errors=True)


def _watch(procs: dict[int, subprocess.Popen[bytes]], group: PodGroup, health: _Health) -> int:
    started = time.monotonic()
    last_seen: float | None = None
    while True:
        exited = {rank: proc.returncode for rank, proc in procs.items() if proc.poll() is not None}
        failed = {rank: code for rank, code in exited.items() if code != 0}
        if failed:
            rank, code = min(failed.items())
            logger.error("worker rank %d exited with %d; this pod leaves the group", rank, code)
            return 1
        if len(exited) == len(procs):
            logger.info("the leader stopped the group; every worker exited")
            return 0
        now = time.monotonic()
        if _leader_answers(group, timeout_s=PROBE_S):
            last_seen = now
        if last_seen is None and now - started > LEADER_WAIT_S:
            logger.error(
                "the leader at %s did not answer within %.0f s; this pod leaves the group",
                group.results_endpoint, LEADER_WAIT_S,
            )  # fmt: skip
            return 1
        if last_seen is not None and now - last_seen > LEADER_LOST_S:
            logger.error(
                "the leader at %s is gone (silent for %.0f s); this pod leaves the group",
                group.results_endpoint, now - last_seen,
            )  # fmt: skip
            return 1
        alive = not exited
        health.ok = alive and last_seen == now
        health.reason = (
            "ok"
            if health.ok
            else ("waiting for the leader" if last_seen is None else "leader not answering")
        )
        time.sleep(max(0.0, PROBE_S - (time.monotonic() - now)))
