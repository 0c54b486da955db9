"""`RemoteRanks`: the leader's view of the ranks on other pods, from real ZMQ TCP connections."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import zmq

from fleetserve.engine.distributed.pod_group import PodGroup
from fleetserve.engine.distributed.remote_ranks import RemoteRanks, heartbeats

GROUP = PodGroup(pod_index=0, num_pods=2, world_size=4, leader_address="127.0.0.1")


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _bound(ctx: zmq.Context[zmq.Socket[bytes]]) -> tuple[zmq.Socket[bytes], str]:
    # The kernel's port, chosen in the bind itself: a port chosen first (free_port) and bound
    # after was once taken in between by the other test worker ("Address already in use").
    sock = ctx.socket(zmq.PUSH)
    heartbeats(sock)
    sock.bind("tcp://127.0.0.1:*")
    return sock, sock.getsockopt_string(zmq.LAST_ENDPOINT)


def _until(what: str, fn: object, timeout_s: float = 10.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        got = fn()  # type: ignore[operator]
        if got:
            return str(got)
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def test_a_pod_that_never_connects_is_lost_after_the_join_bound(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    sock, _ = _bound(ctx)
    remote = RemoteRanks({2: sock}, GROUP, join_timeout_s=0.5)
    assert remote.lost() is None
    lost = _until("the join bound", remote.lost)
    assert lost == "pod(s) [1] of the group (ranks [2]) did not connect to the leader within 0.5 s"
    remote.close()


def test_a_connected_rank_that_goes_away_is_lost_and_one_that_stays_is_not(
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    sock2, url2 = _bound(ctx)
    sock3, url3 = _bound(ctx)
    remote = RemoteRanks({2: sock2, 3: sock3}, GROUP, join_timeout_s=30)
    peers = []
    for url in (url2, url3):
        peer = ctx.socket(zmq.PULL)
        peer.connect(url)
        peers.append(peer)
    _until("both ranks connected", lambda: remote.lost() is None and remote.connected == {2, 3})
    time.sleep(0.5)
    assert remote.lost() is None  # connected and alive: heartbeats answered
    peers[1].close(linger=0)
    lost = _until("the disconnect", remote.lost)
    assert lost == (
        "worker rank 3 on pod 1 of the group disconnected (its process or pod went away)"
    )
    peers[0].close(linger=0)
    remote.close()
