"""Free TCP ports for the processes fleetserve starts itself: the local fleet's engines and router,
the rendezvous of multi-process engines, the dev cluster's control plane, the benchmarks' servers.

Choosing a port and binding it are two steps, and a process that binds seconds later (an engine
binds its HTTP port once its core is up) leaves a window in which anything may take the port. With
the kernel's choice (an ephemeral port, the default here) the likeliest taker is an outgoing
connection anywhere on the machine, whose source port comes from the same range: on a busy machine
(a dev cluster beside a test suite in two workers) that happens. `FLEETSERVE_PORT_RANGE` moves the
choice to a range of its own, outside `net.ipv4.ip_local_port_range`, which only explicit binds use.
"""

from __future__ import annotations

import errno
import secrets
import socket
from contextlib import ExitStack

from fleetserve.envs import env_name, read_env

__all__ = ["bind_port", "free_port", "free_ports", "parse_port_range"]

_VARIABLE = env_name("port_range")


def parse_port_range(text: str) -> tuple[int, int]:
    """`"LOW-HIGH"` → (LOW, HIGH), both included.

    Raises:
        ValueError: not two integers with 1 <= LOW <= HIGH <= 65535 (the message names
            FLEETSERVE_PORT_RANGE).
    """
    low_text, sep, high_text = text.partition("-")
    try:
        low, high = int(low_text), int(high_text)
    except ValueError:
        low = high = 0
    if not sep or not 1 <= low <= high <= 65535:
        raise ValueError(
            f"{_VARIABLE} must be LOW-HIGH with 1 <= LOW <= HIGH <= 65535, got {text!r}"
        )
    return low, high


def free_ports(
    count: int, host: str = "127.0.0.1", *, port_range: tuple[int, int] | None = None
) -> list[int]:
    """`count` distinct TCP ports that were free on `host` a moment ago.

    All of them are bound at once and then released, so they differ from each other. They come
    from `port_range` (default: `FLEETSERVE_PORT_RANGE` when set), scanned from a random start so
    that processes choosing at the same time rarely try the same port first; otherwise the kernel
    chooses ephemeral ones. Nothing holds them afterwards: the caller binds them soon.

    Raises:
        ValueError: `count` < 1, or `FLEETSERVE_PORT_RANGE` does not parse.
        OSError: the range holds fewer than `count` free ports (EADDRINUSE).
    """
    if count < 1:
        raise ValueError(f"count must be >= 1, got {count}")
    if port_range is None:
        configured = read_env().port_range
        port_range = None if configured is None else parse_port_range(configured)
    if port_range is None:
        candidates = [0] * count  # the kernel chooses
    else:
        low, high = port_range
        size = high - low + 1
        start = secrets.randbelow(size)
        candidates = [low + (start + i) % size for i in range(size)]
    with ExitStack() as held:
        ports: list[int] = []
        for candidate in candidates:
            sock = socket.socket()
            try:
                sock.bind((host, candidate))
            except OSError:
                sock.close()
                if candidate == 0:
                    raise
                continue
            held.enter_context(sock)
            ports.append(int(sock.getsockname()[1]))
            if len(ports) == count:
                return ports
    raise OSError(
        errno.EADDRINUSE, f"fewer than {count} free ports on {host} in {_VARIABLE} {low}-{high}"
    )


def free_port(host: str = "127.0.0.1") -> int:
    """One port as `free_ports` chooses them."""
    return free_ports(1, host)[0]


def bind_port(host: str, port: int, *, what: str) -> socket.socket:
    """A TCP socket bound to `host`:`port` (any address family `host` resolves to), not yet
    listening: the caller serves on it or closes it.

    It binds with SO_REUSEADDR, as aiohttp does: a port whose last connections are in TIME_WAIT
    is free to serve on. Until it listens, Linux lets another SO_REUSEADDR socket bind the same
    port (whichever listens first serves; vLLM's early bind behaves the same); plain binds, and
    the source ports of outgoing connections, cannot take it.

    Raises:
        ValueError: `host` does not resolve, or the port cannot be bound (in use, or not an
            address of this machine); the message names `what` (the flags that set it) and why.
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except socket.gaierror as exc:
        raise ValueError(f"--host {host!r} does not resolve: {exc.strerror}") from exc
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise ValueError(
            f"{what} {host}:{port} cannot be bound ({exc.strerror}); pick another, or stop what"
            " listens there"
        ) from exc
    return sock
