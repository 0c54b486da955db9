"""`fleetserve.fleet.supervisor.Supervisor` against real child processes (small python -c
programs): prefixed output, health-gated stages, a child's death stopping the others, SIGKILL after
the grace period, start-up failures naming the process, and no process left behind after Ctrl-C,
SIGTERM or even a SIGKILL of the supervisor."""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable

import pytest

from fleetserve.common.ports import free_port
from fleetserve.fleet.supervisor import MAX_LINE_BYTES, Child, StartupError, Supervisor
from tests.fleet.children import (
    PY,
    alive,
    driver_argv,
    driver_env,
    health_server,
    ignores_sigterm,
    prints,
    sleeper,
    wait_gone,
    with_grandchild,
)


def _until(what: str, check: Callable[[], object], timeout_s: float = 20.0) -> object:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def _pids(out: io.StringIO, name: str) -> list[int]:
    match = re.search(rf"^\[{name}\] pids ([\d ]+)$", out.getvalue(), re.M)
    return [int(p) for p in match.group(1).split()] if match else []


def test_every_line_is_prefixed_by_its_child_and_long_lines_are_split() -> None:
    out = io.StringIO()
    long = [
        PY,
        "-c",
        "import sys, time; sys.stdout.write('x' * 200000 + '\\nend\\n'); sys.stdout.flush(); time.sleep(600)",
    ]
    sup = Supervisor(
        [[Child("a", prints("hello from a")), Child("b", prints("oops from b", stderr=True)),
          Child("long", long)]], out=out, grace_s=5,
    )  # fmt: skip
    sup.start()
    _until("all lines", lambda: "[long] end" in out.getvalue() and "[b] oops" in out.getvalue())
    sup.request_stop(0)
    assert sup.wait() == 0
    lines = out.getvalue().splitlines()
    assert "[a] hello from a" in lines
    assert "[b] oops from b" in lines  # stderr too
    pieces = [line.removeprefix("[long] ") for line in lines if line.startswith("[long] x")]
    assert sum(len(p) for p in pieces) == 200000
    assert len(pieces) == 4 and max(len(p) for p in pieces) <= MAX_LINE_BYTES
    assert all(not alive(pid) for pid in sup.pids().values())


def test_a_dying_child_stops_the_others_and_their_children() -> None:
    out = io.StringIO()
    sup = Supervisor(
        [[Child("a", with_grandchild()), Child("b", prints("bye", then_exit=3, after_s=1.0))]],
        out=out,
        grace_s=5,
    )
    sup.start()
    pids = _until("a's pids", lambda: _pids(out, "a"))
    assert isinstance(pids, list) and len(pids) == 2
    started = time.monotonic()
    assert sup.wait() == 1
    assert time.monotonic() - started < 6
    assert "[up] b exited with code 3; stopping the others" in out.getvalue().splitlines()
    # a and the process a started (same process group) are gone, not orphaned.
    assert wait_gone(pids, timeout_s=1) == []


def test_a_child_ignoring_sigterm_is_killed_after_the_grace_period() -> None:
    out = io.StringIO()
    sup = Supervisor([[Child("stubborn", ignores_sigterm())]], out=out, grace_s=0.5)
    sup.start()
    pid = _until("its pid", lambda: _pids(out, "stubborn"))
    started = time.monotonic()
    sup.request_stop(0)
    assert sup.wait() == 0
    assert 0.5 <= time.monotonic() - started < 5
    assert "[up] stubborn still running 0.5 s after SIGTERM: SIGKILL" in out.getvalue()
    assert isinstance(pid, list) and not alive(pid[0])


def test_the_next_stage_starts_only_once_the_previous_one_is_healthy() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/health"
    # The second stage checks for itself that the first one answers 200 when it starts.
    check = [PY, "-c", f"import urllib.request as u, time; print('saw', u.urlopen({url!r}).status, flush=True); time.sleep(600)"]  # fmt: skip
    out = io.StringIO()
    sup = Supervisor(
        [[Child("engine", health_server(port, healthy_after_s=1.5), health_url=url)],
         [Child("router", check)]], out=out, grace_s=5,
    )  # fmt: skip
    started = time.monotonic()
    sup.start()
    assert time.monotonic() - started >= 1.5
    _until("the router's line", lambda: "[router] saw 200" in out.getvalue())
    sup.request_stop(0)
    assert sup.wait() == 0
    text = out.getvalue()
    assert text.index(f"[up] engine is up: {url} answers 200") < text.index("[router] saw 200")


def test_a_child_exiting_during_start_up_is_named_and_the_others_are_stopped() -> None:
    port = free_port()
    out = io.StringIO()
    sup = Supervisor(
        [[Child("prefill", with_grandchild()),
          Child("decode", prints("error: --bad-flag is not a flag", then_exit=2, after_s=0.5),
                health_url=f"http://127.0.0.1:{port}/health")]], out=out, grace_s=5,
    )  # fmt: skip
    with pytest.raises(StartupError) as info:
        sup.start()
    assert info.value.name == "decode"
    assert info.value.reason == "exited with code 2 during start-up"
    assert info.value.tail == ["error: --bad-flag is not a flag"]
    assert str(info.value).startswith("decode exited with code 2 during start-up")
    assert wait_gone(_pids(out, "prefill") + list(sup.pids().values()), timeout_s=1) == []


def test_a_child_that_never_becomes_healthy_times_out_naming_its_url() -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}/health"
    out = io.StringIO()
    sup = Supervisor(
        [[Child("decode", health_server(port, healthy_after_s=600), health_url=url)]],
        out=out,
        startup_timeout_s=1.0,
        grace_s=5,
    )
    with pytest.raises(
        StartupError, match=re.escape(f"decode did not answer 200 on {url} within 1 s")
    ):
        sup.start()
    assert wait_gone(list(sup.pids().values()), timeout_s=1) == []


def test_a_command_that_cannot_start_is_named() -> None:
    sup = Supervisor([[Child("router", ["/nonexistent/fleetserve", "router"])]], out=io.StringIO())
    with pytest.raises(
        StartupError, match=r"^router could not be started \(/nonexistent/fleetserve\)"
    ):
        sup.start()


def test_bad_children_are_refused() -> None:
    with pytest.raises(ValueError, match="unique"):
        Supervisor([[Child("a", ["true"])], [Child("a", ["true"])]])
    with pytest.raises(ValueError, match="differ from 'up'"):
        Supervisor([[Child("up", ["true"])]])
    with pytest.raises(ValueError, match="argv must not be empty"):
        Child("a", [])
    with pytest.raises(ValueError, match="child name"):
        Child("a b", ["true"])
    with pytest.raises(ValueError, match="at least one child"):
        Supervisor([[]])


def _driver(stages: list[list[dict[str, object]]], **settings: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        driver_argv(stages, **settings), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env=driver_env(),
    )  # fmt: skip


def _read_until_ready(proc: subprocess.Popen[str]) -> list[str]:
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:
        lines.append(line.rstrip("\n"))
        if line.startswith("[up] READY"):
            return lines
    raise AssertionError(f"the supervisor exited before it was up: {lines}")


def _all_pids(lines: list[str]) -> list[int]:
    return [int(p) for line in lines if " pids " in line for p in line.split(" pids ")[1].split()]


def _read_pids(proc: subprocess.Popen[str], lines: list[str], count: int) -> list[int]:
    """Read the supervisor's output until its children printed `count` pids in all."""
    assert proc.stdout is not None
    while len(_all_pids(lines)) < count:
        line = proc.stdout.readline()
        assert line, f"the supervisor exited: {lines}"
        lines.append(line.rstrip("\n"))
    return _all_pids(lines)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_ctrl_c_or_sigterm_stops_everything_and_exits_0(sig: signal.Signals) -> None:
    port = free_port()
    proc = _driver(
        [[{"name": "prefill", "argv": with_grandchild()},
          {"name": "decode", "argv": health_server(port), "health_url": f"http://127.0.0.1:{port}/health"}],
         [{"name": "router", "argv": ignores_sigterm()}]], grace_s=1.0,
    )  # fmt: skip
    pids = _read_pids(proc, _read_until_ready(proc), 3)
    proc.send_signal(sig)
    rest, _ = proc.communicate(timeout=20)
    assert proc.returncode == 0, rest
    assert "[up] router still running 1 s after SIGTERM: SIGKILL" in rest
    assert wait_gone(pids, timeout_s=1) == []


def test_a_killed_supervisor_leaves_no_child_behind() -> None:
    proc = _driver([[{"name": "a", "argv": sleeper()}, {"name": "b", "argv": sleeper()}]])
    pids = _read_pids(proc, _read_until_ready(proc), 2)
    proc.kill()
    proc.wait()
    # The kernel sends each child SIGTERM when the supervisor dies (PR_SET_PDEATHSIG).
    assert wait_gone(pids, timeout_s=10) == []


def test_what_a_killed_child_leaves_in_its_group_is_stopped_too() -> None:
    """An engine killed by SIGKILL leaves its engine core behind: its process group is stopped."""
    out = io.StringIO()
    sup = Supervisor(
        [[Child("decode", with_grandchild()), Child("router", sleeper())]], out=out, grace_s=5
    )
    sup.start()
    pids = _until("decode's pids", lambda: _pids(out, "decode"))
    assert isinstance(pids, list) and len(pids) == 2
    os.kill(pids[0], signal.SIGKILL)
    assert sup.wait() == 1
    assert "[up] decode was killed by SIGKILL; stopping the others" in out.getvalue().splitlines()
    assert wait_gone([pids[1], *sup.pids().values()], timeout_s=1) == []
