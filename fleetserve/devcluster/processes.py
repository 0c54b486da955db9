"""Start, identify and stop background processes; pick free loopback ports; wait for health.

Every process is started in its own session (process group id == pid) so that stopping it also
stops whatever it spawned. A `ProcessRecord` stores the pid together with the kernel's start time
of that pid, so a later `fleetserve dev-cluster down` never signals an unrelated process that
happens to reuse the pid.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ProcessRecord",
    "is_port_open",
    "process_start_time",
    "spawn",
    "stop",
    "wait_for",
    "wait_http_ok",
]

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class ProcessRecord:
    """One started process as persisted in the cluster state file."""

    name: str
    pid: int
    start_time: int
    """Field 22 of /proc/<pid>/stat (clock ticks since boot): tells a reused pid apart."""
    log: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> ProcessRecord:
        return cls(
            name=data["name"],
            pid=int(data["pid"]),
            start_time=int(data["start_time"]),
            log=data["log"],
        )

    def is_alive(self) -> bool:
        """True while this very process exists (and is not a zombie)."""
        return process_start_time(self.pid) == self.start_time


def process_start_time(pid: int) -> int | None:
    """The start time of `pid`, or None when there is no such live (non-zombie) process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may contain spaces and parentheses: split after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    if fields[0] == "Z":
        return None
    return int(fields[19])


def is_port_open(port: int, host: str = "127.0.0.1") -> bool:
    """True when something accepts TCP connections on host:port."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.settimeout(0.2)
        return s.connect_ex((host, port)) == 0


def spawn(
    name: str,
    argv: Sequence[str | Path],
    *,
    log: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    die_with_parent: signal.Signals | None = None,
) -> ProcessRecord:
    """Start `argv` detached (new session, stdin closed, stdout+stderr appended to `log`).

    By default the child outlives the caller: `fleetserve dev-cluster up` exits while the
    cluster runs. With `die_with_parent` the kernel sends it that signal when the calling thread
    exits (PR_SET_PDEATHSIG), so a test run killed before its teardown leaves no cluster behind.
    """
    preexec = None
    if die_with_parent is not None:
        libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork: the child only calls it
        signum = int(die_with_parent)

        def preexec() -> None:
            libc.prctl(_PR_SET_PDEATHSIG, signum)

    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [str(a) for a in argv],
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
            preexec_fn=preexec,
        )
    start = process_start_time(proc.pid)
    if start is None:
        raise RuntimeError(f"{name} exited immediately; see {log}")
    return ProcessRecord(name=name, pid=proc.pid, start_time=start, log=str(log))


def _reap(pid: int) -> None:
    # Children of this Python process become zombies until waited for.
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, os.WNOHANG)


def stop(record: ProcessRecord, *, timeout_s: float = 10.0) -> None:
    """SIGTERM the process group of `record`, then SIGKILL it after `timeout_s`. Idempotent."""
    if not record.is_alive():
        return
    for sig, wait_s in ((signal.SIGTERM, timeout_s), (signal.SIGKILL, 5.0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(record.pid, sig)
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline:
            _reap(record.pid)
            if not record.is_alive():
                _reap(record.pid)  # it may have died between the two calls
                return
            time.sleep(0.05)
    raise RuntimeError(f"{record.name} (pid {record.pid}) survived SIGKILL")


def wait_for(
    what: str,
    check: Callable[[], bool],
    *,
    timeout_s: float,
    interval_s: float = 0.2,
    alive: ProcessRecord | Sequence[ProcessRecord] = (),
) -> None:
    """Poll `check` until it returns True; raise TimeoutError naming `what` otherwise.

    When a process in `alive` dies first, fail at once and quote the end of its log.
    """
    watched = (alive,) if isinstance(alive, ProcessRecord) else tuple(alive)
    deadline = time.monotonic() + timeout_s
    while True:
        if check():
            return
        for record in watched:
            if not record.is_alive():
                tail = Path(record.log).read_text(errors="replace")[-3000:]
                raise RuntimeError(
                    f"{record.name} exited while waiting for {what}; log tail:\n{tail}"
                )
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(interval_s)


def wait_http_ok(
    url: str,
    *,
    timeout_s: float,
    ssl_context: ssl.SSLContext | None = None,
    alive: ProcessRecord | Sequence[ProcessRecord] = (),
) -> None:
    """Wait until GET `url` answers 200 (no proxies: the URL is always on loopback)."""
    opener = urllib.request.build_opener(
        urllib.request.ProxyHandler({}), urllib.request.HTTPSHandler(context=ssl_context)
    )

    def ok() -> bool:
        try:
            with opener.open(url, timeout=2) as resp:
                return int(resp.status) == 200
        except (urllib.error.URLError, OSError):
            return False

    wait_for(url, ok, timeout_s=timeout_s, alive=alive)
