"""Free ports: chosen from `FLEETSERVE_PORT_RANGE` when set, distinct, and clear errors."""

from __future__ import annotations

import errno
import os
import socket
from itertools import pairwise
from pathlib import Path

import pytest

from fleetserve.common.ports import bind_port, free_port, free_ports, parse_port_range
from tests.conftest import SUITE_PORT_RANGE, worker_port_range


def _bindable(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_ports_from_a_range_are_in_it_distinct_and_free() -> None:
    low, high = parse_port_range(os.environ["FLEETSERVE_PORT_RANGE"])
    ports = free_ports(5)
    assert len(set(ports)) == 5
    assert all(low <= p <= high and _bindable(p) for p in ports)


def test_a_taken_port_is_skipped_and_a_full_range_is_a_clear_error() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        port = taken.getsockname()[1]
        # The range's only other port is free: it is the one chosen, every time.
        other = port + 1 if _bindable(port + 1) else port - 1
        span = (min(port, other), max(port, other))
        assert {free_ports(1, port_range=span)[0] for _ in range(10)} == {other}
        with pytest.raises(OSError, match=r"fewer than 2 free ports .* FLEETSERVE_PORT_RANGE") as e:
            free_ports(2, port_range=span)
        assert e.value.errno == errno.EADDRINUSE


def test_the_variable_is_read_at_each_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    port = free_ports(1, port_range=(21000, 28999))[0]
    monkeypatch.setenv("FLEETSERVE_PORT_RANGE", f"{port}-{port}")
    assert free_port() == port
    monkeypatch.delenv("FLEETSERVE_PORT_RANGE")
    ephemeral = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
    assert int(ephemeral[0]) <= free_port() <= int(ephemeral[1])  # the kernel's choice


@pytest.mark.parametrize("text", ["", "20000", "a-b", "0-10", "30000-20000", "1-65536", "-5"])
def test_a_bad_range_names_the_variable(text: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match=r"FLEETSERVE_PORT_RANGE must be LOW-HIGH"):
        parse_port_range(text)
    monkeypatch.setenv("FLEETSERVE_PORT_RANGE", text or " ")
    with pytest.raises(ValueError, match=r"FLEETSERVE_PORT_RANGE"):
        free_port()


def test_count_must_be_positive() -> None:
    with pytest.raises(ValueError, match="count must be >= 1, got 0"):
        free_ports(0)


def test_the_suite_chooses_below_the_ephemeral_ports_and_each_worker_its_own() -> None:
    low, high = parse_port_range(SUITE_PORT_RANGE)
    ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert high < ephemeral_low
    assert worker_port_range(SUITE_PORT_RANGE, None, 1) == SUITE_PORT_RANGE
    shares = [parse_port_range(worker_port_range(SUITE_PORT_RANGE, f"gw{i}", 3)) for i in range(3)]
    assert shares[0][0] == low and all(a[1] < b[0] for a, b in pairwise(shares))
    assert shares[-1][1] <= high
    with pytest.raises(ValueError, match="cannot be split"):
        worker_port_range("20000-20001", "gw0", 3)


def test_bind_port_binds_without_listening_and_says_why_it_cannot() -> None:
    port = free_port()
    with bind_port("127.0.0.1", port, what="--port") as sock:
        assert sock.getsockname() == ("127.0.0.1", port)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR)
        assert not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        # A plain bind (as free_ports makes) or a connection's source port cannot take it.
        with socket.socket() as other, pytest.raises(OSError) as taken:
            other.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
        sock.listen()
        in_use = rf"--port 127\.0\.0\.1:{port} cannot be bound \(Address already in use\)"
        with pytest.raises(ValueError, match=in_use):  # nor, once it listens, anything
            bind_port("127.0.0.1", port, what="--port")
    with pytest.raises(ValueError, match=r"--host 'no-such-host\.invalid' does not resolve"):
        bind_port("no-such-host.invalid", 0, what="--port")


@pytest.mark.skipif(not socket.has_ipv6, reason="no IPv6 in this Python")
def test_bind_port_takes_the_family_its_host_resolves_to() -> None:
    try:
        sock = bind_port("::1", 0, what="--port")
    except ValueError as exc:  # a kernel without IPv6 loopback
        pytest.skip(f"::1 cannot be bound here: {exc}")
    with sock:
        assert sock.family == socket.AF_INET6
