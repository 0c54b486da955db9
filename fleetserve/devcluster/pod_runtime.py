"""Run one pod's containers as local processes: start, probe, restart, stop, report status.

Each container process gets its own session (process group), so stopping a pod kills the whole
tree it spawned. Probes run in one daemon thread per container start; they only flip flags that
the agent's reconcile loop reads. Timestamps in statuses are RFC 3339 UTC, as the API expects.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import socket
import subprocess
import threading
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from fleetserve.devcluster.pod_launch import ContainerLaunch, PodLaunch
from fleetserve.devcluster.podspec import Probe, pod_phase, restart_backoff_s, should_restart
from fleetserve.devcluster.processes import ProcessRecord, process_start_time

__all__ = ["Container", "PodRuntime", "now_rfc3339"]


def now_rfc3339() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _probe_once(probe: Probe, launch: ContainerLaunch) -> bool:
    try:
        if probe.kind == "http":
            # http.client, not urllib: proxy environment variables must not apply to pod IPs.
            cls = (
                http.client.HTTPSConnection
                if probe.scheme == "HTTPS"
                else http.client.HTTPConnection
            )
            conn = cls(launch.pod_ip, probe.port, timeout=probe.timeout_s)
            try:
                conn.request("GET", probe.path)
                return 200 <= conn.getresponse().status < 400
            finally:
                conn.close()
        if probe.kind == "tcp":
            with socket.create_connection((launch.pod_ip, probe.port), timeout=probe.timeout_s):
                return True
        result = subprocess.run(
            list(probe.command), env=dict(launch.env), cwd=launch.cwd, timeout=probe.timeout_s,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        return result.returncode == 0
    except (OSError, http.client.HTTPException, subprocess.TimeoutExpired):
        return False


@dataclass(slots=True)
class _Run:
    """One start of a container: the process and what its probe thread observed."""

    proc: subprocess.Popen[bytes]
    record: ProcessRecord
    started_at: str
    stop: threading.Event = field(default_factory=threading.Event)
    ready: bool = False
    liveness_failed: bool = False


class Container:
    """One container's process across restarts. Not thread-safe: only the agent loop calls it."""

    def __init__(self, launch: ContainerLaunch, restart_policy: str, *, start: bool = True) -> None:
        self.launch = launch
        self.restart_policy = restart_policy
        self.restart_count = 0
        self.run: _Run | None = None
        self.terminated: dict[str, Any] | None = None
        self.last_terminated: dict[str, Any] | None = None
        self.next_start_at: float | None = time.monotonic() if start else None
        """When to (re)start; None while held back (behind init containers) or done."""
        self.stopping = False

    def release(self, now: float) -> None:
        """Start a held-back container on the next tick."""
        if self.run is None and self.terminated is None and not self.stopping:
            self.next_start_at = now

    @property
    def has_succeeded(self) -> bool:
        """Exited 0 and will not be restarted (what an init container must do)."""
        done = self.run is None and self.next_start_at is None and self.terminated is not None
        return done and self.terminated is not None and self.terminated["exitCode"] == 0

    @property
    def has_failed(self) -> bool:
        """Exited non-zero (or failed to start) and will not be restarted."""
        done = self.run is None and self.next_start_at is None and self.terminated is not None
        return done and self.terminated is not None and self.terminated["exitCode"] != 0

    def _start(self) -> None:
        self.launch.log.parent.mkdir(parents=True, exist_ok=True)
        self.launch.cwd.mkdir(parents=True, exist_ok=True)
        with open(self.launch.log, "ab") as out:
            out.write(
                f"--- fleetserve local node: start #{self.restart_count} at {now_rfc3339()}\n".encode()
            )
            out.flush()
            proc = subprocess.Popen(
                list(self.launch.argv), env=dict(self.launch.env), cwd=self.launch.cwd,
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
        start = process_start_time(proc.pid) or 0
        record = ProcessRecord(
            name=f"{self.launch.log.stem}", pid=proc.pid, start_time=start, log=str(self.launch.log)
        )
        self.run = _Run(
            proc=proc, record=record, started_at=now_rfc3339(), ready=self.launch.readiness is None
        )
        self.terminated = None
        self.next_start_at = None
        for probe, is_readiness in ((self.launch.readiness, True), (self.launch.liveness, False)):
            if probe is not None:
                args = (self.run, probe, is_readiness)
                threading.Thread(target=self._probe_loop, args=args, daemon=True).start()

    def _probe_loop(self, run: _Run, probe: Probe, is_readiness: bool) -> None:
        successes = failures = 0
        if run.stop.wait(probe.initial_delay_s):
            return
        while not run.stop.is_set():
            ok = _probe_once(probe, self.launch)
            successes, failures = (successes + 1, 0) if ok else (0, failures + 1)
            if is_readiness:
                if successes >= probe.success_threshold:
                    run.ready = True
                elif failures >= probe.failure_threshold:
                    run.ready = False
            elif failures >= probe.failure_threshold:
                run.liveness_failed = True
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(run.proc.pid, signal.SIGKILL)
                return
            run.stop.wait(probe.period_s)

    def tick(self, now: float) -> None:
        """Notice an exit (and schedule a restart per restartPolicy) or start when due."""
        run = self.run
        if run is not None:
            code = run.proc.poll()
            if code is None:
                return
            run.stop.set()
            self.run = None
            # The kubelet reports death by signal N as exit code 128+N.
            exit_code = code if code >= 0 else 128 - code
            reason = "Completed" if exit_code == 0 else "Error"
            self.terminated = {
                "exitCode": exit_code, "reason": reason, "startedAt": run.started_at,
                "finishedAt": now_rfc3339(), "containerID": f"local://{run.proc.pid}",
            }  # fmt: skip
            if not self.stopping and should_restart(self.restart_policy, exit_code):
                self.next_start_at = now + restart_backoff_s(self.restart_count)
        if self.next_start_at is not None and now >= self.next_start_at and not self.stopping:
            if self.terminated is not None:
                self.last_terminated = self.terminated
                self.restart_count += 1
            try:
                self._start()
            except OSError as e:  # e.g. the command does not exist: like a container exiting 128
                self.terminated = {
                    "exitCode": 128, "reason": "StartError", "message": str(e),
                    "startedAt": now_rfc3339(), "finishedAt": now_rfc3339(),
                }  # fmt: skip
                if should_restart(self.restart_policy, 128):
                    self.next_start_at = now + restart_backoff_s(self.restart_count)
                else:
                    self.next_start_at = None

    def signal(self, sig: signal.Signals) -> None:
        """Send `sig` to the process group; no more restarts after this."""
        self.stopping = True
        self.next_start_at = None
        if self.run is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.run.proc.pid, sig)

    @property
    def is_stopped(self) -> bool:
        return self.run is None or self.run.proc.poll() is not None

    @property
    def is_ready(self) -> bool:
        return self.run is not None and self.run.ready and self.run.proc.poll() is None

    def state_name(self) -> str:
        if self.run is not None:
            return "running"
        return (
            "waiting" if self.next_start_at is not None or self.terminated is None else "terminated"
        )

    def status(self) -> dict[str, Any]:
        """A `containerStatuses[]` entry."""
        state: dict[str, Any]
        if self.run is not None:
            state = {"running": {"startedAt": self.run.started_at}}
        elif self.next_start_at is not None and self.terminated is not None:
            state = {"waiting": {"reason": "CrashLoopBackOff", "message": "restarting after exit"}}
        elif self.terminated is not None:
            state = {"terminated": self.terminated}
        else:
            reason = "ContainerCreating" if self.next_start_at is not None else "PodInitializing"
            state = {"waiting": {"reason": reason}}
        status: dict[str, Any] = {
            "name": self.launch.name, "image": self.launch.image, "imageID": "",
            "ready": self.is_ready, "started": self.run is not None,
            "restartCount": self.restart_count, "state": state,
        }  # fmt: skip
        if self.run is not None:
            status["containerID"] = f"local://{self.run.proc.pid}"
        if self.last_terminated is not None:
            status["lastState"] = {"terminated": self.last_terminated}
        return status


class PodRuntime:
    """All containers of one pod, on one loopback IP.

    Init containers run one after another (restarted on failure unless restartPolicy is Never);
    the containers start together once the last one succeeded.
    """

    def __init__(self, uid: str, ip: str, launch: PodLaunch, restart_policy: str) -> None:
        self.uid = uid
        self.ip = ip
        init_policy = "Never" if restart_policy == "Never" else "OnFailure"
        self.init = [Container(c, init_policy, start=False) for c in launch.init]
        self.containers = [Container(c, restart_policy, start=False) for c in launch.containers]
        self.start_time = now_rfc3339()
        self.kill_at: float | None = None
        self.initialized = False
        self._since: dict[str, tuple[bool, str]] = {}

    @property
    def _all(self) -> list[Container]:
        return [*self.init, *self.containers]

    def _advance_init(self, now: float) -> None:
        for c in self.init:
            if c.has_succeeded:
                continue
            if not c.has_failed:
                c.release(now)
                c.tick(now)
            return
        self.initialized = True
        for c in self.containers:
            c.release(now)

    def tick(self, now: float) -> None:
        if not self.initialized and self.kill_at is None:
            self._advance_init(now)
        for c in self._all:
            c.tick(now)
        if self.kill_at is not None and now >= self.kill_at:
            for c in self._all:
                c.signal(signal.SIGKILL)

    def terminate(self, grace_s: float) -> None:
        """SIGTERM every container now; SIGKILL whatever still runs after `grace_s`."""
        if self.kill_at is None:
            self.kill_at = time.monotonic() + grace_s
            for c in self._all:
                c.signal(signal.SIGTERM)

    @property
    def is_terminating(self) -> bool:
        return self.kill_at is not None

    @property
    def is_stopped(self) -> bool:
        return all(c.is_stopped for c in self._all)

    def records(self) -> list[ProcessRecord]:
        return [c.run.record for c in self._all if c.run is not None]

    def _condition(self, kind: str, value: bool) -> dict[str, Any]:
        previous = self._since.get(kind)
        if previous is None or previous[0] != value:
            self._since[kind] = (value, now_rfc3339())
        return {
            "type": kind,
            "status": "True" if value else "False",
            "lastTransitionTime": self._since[kind][1],
        }

    def _phase(self) -> str:
        if not self.initialized:
            return "Failed" if any(c.has_failed for c in self.init) else "Pending"
        states = [c.state_name() for c in self.containers]
        codes = [c.terminated["exitCode"] if c.terminated else None for c in self.containers]
        restarting = any(
            c.next_start_at is not None and c.terminated is not None for c in self.containers
        )
        return pod_phase(states, codes, restarting)

    def status(self) -> dict[str, Any]:
        """The pod `status` the agent writes (phase, IPs, conditions, container statuses)."""
        ready = self.initialized and all(c.is_ready for c in self.containers)
        status: dict[str, Any] = {
            "phase": self._phase(),
            "hostIP": "127.0.0.1",
            "hostIPs": [{"ip": "127.0.0.1"}],
            "podIP": self.ip,
            "podIPs": [{"ip": self.ip}],
            "startTime": self.start_time,
            "conditions": [
                self._condition("PodReadyToStartContainers", True),
                self._condition("Initialized", self.initialized),
                self._condition("ContainersReady", ready),
                self._condition("Ready", ready),
                self._condition("PodScheduled", True),
            ],
            "containerStatuses": [c.status() for c in self.containers],
        }
        if self.init:
            status["initContainerStatuses"] = [c.status() for c in self.init]
        return status
