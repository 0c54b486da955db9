"""A small process supervisor: named child commands started in stages, health-gated, stopped together.

`Supervisor` runs the stages one after another: it starts every child of a stage, waits until each
child's health URL answers 200 (a child without one counts as up once started), then starts the
next stage. Each child runs in its own process group (its own session) and gets SIGTERM when the
supervisor dies (PR_SET_PDEATHSIG), so its own children (an engine's core process) are stopped
with it and nothing outlives the supervisor. Every line a child writes to stdout or stderr is
copied to `out` prefixed with the child's name (`[prefill] ...`); a line longer than
`MAX_LINE_BYTES` is split, so no reader buffers without bound.

Once all stages are up the supervisor watches them: when any child exits, or when `request_stop`
is called (SIGINT/SIGTERM under `run`), every child is sent SIGTERM (the last stage first) and,
after `grace_s`, whatever is left of its process group SIGKILL. `run` returns 0 after a requested
stop and 1 when a child died or failed to start.

This module imports only the standard library: `fleetserve up` must not load torch in the
process that supervises the engines.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TextIO

__all__ = [
    "MAX_LINE_BYTES",
    "Child",
    "StartupError",
    "Supervisor",
    "describe_exit",
]

MAX_LINE_BYTES = 64 * 1024
"""Longest line copied at once; a longer one is copied in pieces of this size."""
_TAIL_LINES = 20
"""Lines of a child's output kept for the error message when it fails to start."""
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True, slots=True)
class Child:
    """One supervised command."""

    name: str
    argv: Sequence[str]
    health_url: str | None = None
    """Up once this answers HTTP 200 (None: up once started)."""
    env: Mapping[str, str] | None = None
    """Extra environment on top of the supervisor's own."""

    def __post_init__(self) -> None:
        if not self.name or not self.name.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"child name must be letters, digits, '-' or '_', got {self.name!r}")
        if not self.argv:
            raise ValueError(f"child {self.name!r}: argv must not be empty")


class StartupError(RuntimeError):
    """A child exited, or its health URL did not answer 200, before the fleet was up."""

    def __init__(self, name: str, reason: str, tail: Sequence[str] = ()) -> None:
        self.name = name
        self.reason = reason
        self.tail = list(tail)
        message = f"{name} {reason}"
        if self.tail:
            message += "; its last output lines:\n" + "\n".join(f"  {t}" for t in self.tail)
        super().__init__(message)


def describe_exit(returncode: int) -> str:
    """'exited with code 2' or 'was killed by SIGKILL' for a Popen return code."""
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with code {returncode}"


@dataclass
class _Running:
    child: Child
    proc: subprocess.Popen[bytes]
    reader: threading.Thread
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=_TAIL_LINES))


class Supervisor:
    """Start `stages` of children in order, watch them, stop them all together.

    Args:
        stages: each a list of children started together; the next stage starts when every
            child of this one is up.
        startup_timeout_s: the longest a stage may take to come up.
        grace_s: how long children get after SIGTERM before their process groups get SIGKILL.
        out: where the prefixed lines (and the supervisor's own `[name] ...` lines) go.
        name: the prefix of the supervisor's own lines.
    """

    def __init__(
        self,
        stages: Sequence[Sequence[Child]],
        *,
        startup_timeout_s: float = 600.0,
        grace_s: float = 10.0,
        out: TextIO | None = None,
        name: str = "up",
        poll_interval_s: float = 0.1,
    ) -> None:
        names = [c.name for stage in stages for c in stage]
        if not names:
            raise ValueError("a supervisor needs at least one child")
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates or name in names:
            raise ValueError(f"child names must be unique and differ from {name!r}: {names}")
        if startup_timeout_s <= 0 or grace_s < 0:
            raise ValueError("startup_timeout_s must be > 0 and grace_s >= 0")
        self.stages = [list(stage) for stage in stages]
        self.startup_timeout_s = startup_timeout_s
        self.grace_s = grace_s
        self.out = out if out is not None else sys.stdout
        self.name = name
        self.poll_interval_s = poll_interval_s
        self._running: list[_Running] = []
        self._write_lock = threading.Lock()
        self._stop = threading.Event()
        self._stop_code = 0
        self._stopped = False

    # -- output ------------------------------------------------------------------------------

    def say(self, message: str) -> None:
        """Write one of the supervisor's own lines."""
        self._write(self.name, message)

    def _write(self, name: str, line: str) -> None:
        with self._write_lock:
            try:
                self.out.write(f"[{name}] {line}\n")
                self.out.flush()
            except (OSError, ValueError):
                pass  # a closed terminal must not stop the supervision

    def _copy_output(self, running: _Running) -> None:
        stream = running.proc.stdout
        assert stream is not None
        with stream:
            while True:
                raw = stream.readline(MAX_LINE_BYTES)
                if not raw:
                    return
                line = raw.decode(errors="replace").rstrip("\r\n")
                running.tail.append(line)
                self._write(running.child.name, line)

    # -- processes ----------------------------------------------------------------------------

    def pids(self) -> dict[str, int]:
        """Name → pid (also the process group id) of every child started so far."""
        return {r.child.name: r.proc.pid for r in self._running}

    def _spawn(self, child: Child) -> _Running:
        libc = ctypes.CDLL(None, use_errno=True)  # loaded before fork: the child only calls it

        def die_with_supervisor() -> None:
            libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM))

        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(child.env or {})}
        try:
            proc = subprocess.Popen(
                list(child.argv),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_supervisor,
            )
        except OSError as exc:
            raise StartupError(
                child.name, f"could not be started ({child.argv[0]}): {exc}"
            ) from exc
        self.say(f"started {child.name} (pid {proc.pid}): {shlex.join(child.argv)}")
        running = _Running(child, proc, threading.Thread())
        running.reader = threading.Thread(
            target=self._copy_output, args=(running,), name=f"log-{child.name}", daemon=True
        )
        running.reader.start()
        self._running.append(running)
        return running

    def start(self) -> None:
        """Start every stage and wait until each is up.

        Must be called from the thread that stays alive while the children run (the kernel
        sends them SIGTERM when the thread that started them exits).

        Raises:
            StartupError: a child exited or did not become healthy in time (the other children
                are then stopped), or `request_stop` was called meanwhile.
        """
        try:
            for stage in self.stages:
                started = [self._spawn(child) for child in stage]
                self._wait_healthy(started)
        except BaseException:
            self.stop()
            raise

    def _wait_healthy(self, stage: list[_Running]) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        pending = [r for r in stage if r.child.health_url is not None]
        while pending:
            for r in list(pending):
                self._check_alive_during_startup(r)
                assert r.child.health_url is not None
                if _healthy(r.child.health_url):
                    self.say(f"{r.child.name} is up: {r.child.health_url} answers 200")
                    pending.remove(r)
            for r in self._running:
                self._check_alive_during_startup(r)
            if not pending:
                return
            if self._stop.is_set():
                raise StartupError(pending[0].child.name, "was still starting when asked to stop")
            if time.monotonic() > deadline:
                r = pending[0]
                raise StartupError(
                    r.child.name,
                    f"did not answer 200 on {r.child.health_url} within"
                    f" {self.startup_timeout_s:g} s",
                    r.tail,
                )
            self._stop.wait(max(self.poll_interval_s, 0.05))

    def _check_alive_during_startup(self, r: _Running) -> None:
        code = r.proc.poll()
        if code is not None:
            r.reader.join(timeout=2)  # the last lines explain the exit
            raise StartupError(r.child.name, f"{describe_exit(code)} during start-up", r.tail)

    def request_stop(self, code: int = 0) -> None:
        """Ask `wait` to return `code` after stopping the children (thread- and signal-safe)."""
        if not self._stop.is_set():
            self._stop_code = code
        self._stop.set()

    def wait(self) -> int:
        """Watch the children until one exits or a stop is requested, then stop them all.

        Returns:
            `request_stop`'s code, or 1 when a child exited on its own.
        """
        code: int | None = None
        while code is None:
            for r in self._running:
                status = r.proc.poll()
                if status is not None:
                    r.reader.join(timeout=2)
                    self.say(f"{r.child.name} {describe_exit(status)}; stopping the others")
                    code = 1
                    break
            else:
                if self._stop.wait(self.poll_interval_s):
                    code = self._stop_code
        self.stop()
        return code

    def stop(self) -> None:
        """SIGTERM every child's process group (last started first), SIGKILL after the grace.

        Idempotent; returns once every child has been reaped and its group is empty.
        """
        if self._stopped:
            return
        self._stopped = True
        for r in reversed(self._running):
            _signal_group(r.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + self.grace_s
        left = list(self._running)
        while left and time.monotonic() < deadline:
            left = [r for r in left if not _group_gone(r)]
            if left:
                time.sleep(0.05)
        for r in left:
            self.say(f"{r.child.name} still running {self.grace_s:g} s after SIGTERM: SIGKILL")
            _signal_group(r.proc.pid, signal.SIGKILL)
        for r in self._running:
            with contextlib.suppress(subprocess.TimeoutExpired):
                r.proc.wait(timeout=5)
            end = time.monotonic() + 5
            while not _group_gone(r) and time.monotonic() < end:
                _signal_group(r.proc.pid, signal.SIGKILL)
                time.sleep(0.05)
            r.reader.join(timeout=2)

    def run(self, on_ready: Callable[[Supervisor], None] | None = None) -> int:
        """`start`, then `on_ready(self)` in a thread, then `wait`; SIGINT/SIGTERM stop it.

        Must be called from the main thread (it installs the signal handlers and restores them).

        Returns:
            0 after a stop was requested (a signal, or `request_stop()` from `on_ready`), 1 when a
            child failed to start or died (the reason is written as a line of the supervisor's).
        """
        previous = {
            sig: signal.signal(sig, lambda *_: self.request_stop(0))
            for sig in (signal.SIGINT, signal.SIGTERM)
        }
        try:
            try:
                self.start()
            except StartupError as exc:
                if self._stop.is_set():
                    self.say("stopped during start-up")
                    return self._stop_code
                # NOTE: the child's lines were printed as they came; name the culprit only.
                self.say(
                    f"start-up failed: {exc.name} {exc.reason} (its output is above, [{exc.name}])"
                )
                return 1
            if on_ready is not None:
                threading.Thread(target=on_ready, args=(self,), daemon=True).start()
            return self.wait()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status) == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def _group_gone(r: _Running) -> bool:
    """The child has exited (reaped here) and no process of its group is left."""
    if r.proc.poll() is None:
        return False
    try:
        os.killpg(r.proc.pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
