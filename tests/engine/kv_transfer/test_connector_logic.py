"""The connector's pure logic, as the seed's scenarios put it (notes part 2 §4, items 24, 26,
29): leases and heartbeats, the reaper, one handshake per peer, TTL eviction, the failure
ledger, and strict `kv_transfer_params` parsing."""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future
from typing import Any

import pytest

from fleetserve.engine.kv_transfer.lease import HeartbeatSchedule, LeaseTable
from fleetserve.engine.kv_transfer.ledger import FailureLedger, TransferStage
from fleetserve.engine.kv_transfer.params import (
    ConsumerParams,
    ProducerParams,
    parse_kv_transfer_params,
)
from fleetserve.engine.kv_transfer.peers import PeerRegistry

# -- leases ------------------------------------------------------------------------------------


def test_a_heartbeat_never_shortens_a_lease() -> None:
    leases = LeaseTable(lease_s=30.0)
    leases.grant("a", now=0.0)
    assert leases.expiry("a") == 30.0
    assert leases.heartbeat(["a"], now=1.0) == ["a"]
    assert leases.expiry("a") == 30.0  # 1 + 20 < 30: kept
    leases.heartbeat(["a"], now=25.0)
    assert leases.expiry("a") == 45.0
    leases.heartbeat(["a"], now=12.0)  # a stale, reordered heartbeat
    assert leases.expiry("a") == 45.0
    assert leases.heartbeat(["unknown"], now=26.0) == []


def test_expired_leases_behind_a_live_one_are_all_reaped_in_one_pass() -> None:
    leases = LeaseTable(lease_s=30.0)
    for key in ("a", "b", "c", "d"):
        leases.grant(key, now=0.0)
    leases.heartbeat(["b"], now=20.0)  # b lives to 40, granted before c and d
    assert leases.reap(now=31.0) == ["a", "c", "d"]
    assert len(leases) == 1 and "b" in leases
    assert leases.reap(now=39.0) == []
    assert leases.reap(now=40.0) == ["b"]


def test_heartbeats_are_due_every_sixth_of_the_lease_per_peer() -> None:
    schedule = HeartbeatSchedule.for_lease(30.0)
    assert schedule.interval_s == 5.0
    schedule.add("a", "p1", now=0.0)
    schedule.add("b", "p1", now=0.0)
    schedule.add("c", "p2", now=2.0)
    assert schedule.due(2.0) == {"p1": ["a", "b"], "p2": ["c"]}
    assert schedule.due(6.9) == {}
    assert schedule.due(7.0) == {"p1": ["a", "b"], "p2": ["c"]}
    schedule.remove("a")
    assert schedule.due(12.0) == {"p1": ["b"], "p2": ["c"]}


# -- handshakes and peers ---------------------------------------------------------------------


def test_100_concurrent_requests_cause_one_handshake_per_peer() -> None:
    started: list[str] = []
    release = threading.Event()

    def handshake(engine_id: str) -> str:
        started.append(engine_id)
        release.wait(5)
        return f"meta-{engine_id}"

    registry: PeerRegistry[str] = PeerRegistry(handshake, clock=time.monotonic)
    futures: list[Future[str]] = []

    def request(i: int) -> None:
        futures.append(registry.connect(f"prefill-{i % 2}"))

    threads = [threading.Thread(target=request, args=(i,)) for i in range(100)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    release.set()
    assert sorted(f.result(5) for f in futures) == ["meta-prefill-0"] * 50 + ["meta-prefill-1"] * 50
    assert sorted(started) == ["prefill-0", "prefill-1"]
    assert registry.num_handshakes == 2
    registry.close()


def test_a_failed_handshake_fails_every_waiting_request_and_is_retried_later() -> None:
    attempts: list[str] = []
    gate = threading.Event()

    def handshake(engine_id: str) -> str:
        attempts.append(engine_id)
        gate.wait(5)
        if len(attempts) == 1:
            raise ConnectionRefusedError("peer down")
        return "ok"

    registry: PeerRegistry[str] = PeerRegistry(handshake, clock=time.monotonic)
    waiting = [registry.connect("p") for _ in range(10)]
    assert len({id(f) for f in waiting}) == 1
    gate.set()
    for future in waiting:
        with pytest.raises(ConnectionRefusedError):
            future.result(5)
    deadline = time.monotonic() + 5
    while "p" in registry and time.monotonic() < deadline:
        time.sleep(0.01)
    assert registry.connect("p").result(5) == "ok"
    assert attempts == ["p", "p"]
    registry.close()


def test_idle_peers_are_evicted_by_ttl_and_bound_but_a_busy_peer_never() -> None:
    now = [0.0]
    registry: PeerRegistry[str] = PeerRegistry(
        lambda engine_id: engine_id, ttl_s=60.0, max_peers=3, clock=lambda: now[0]
    )
    for engine_id in ("busy", "idle-1", "idle-2"):
        registry.connect(engine_id).result(5)
    registry.begin_transfer("busy")
    now[0] = 100.0  # everyone is past the TTL
    registry.connect("new").result(5)  # a new peer appears: stale idle ones go, busy stays
    assert "busy" in registry and "new" in registry
    assert "idle-1" not in registry and "idle-2" not in registry
    for i in range(3):
        registry.connect(f"more-{i}").result(5)
        registry.begin_transfer(f"more-{i}")
    assert "busy" in registry  # over the bound, every peer busy: nobody is cut off
    registry.end_transfer("busy")
    now[0] = 101.0
    registry.connect("last").result(5)
    assert "busy" not in registry  # idle now: the least recently active one goes
    registry.close()


# -- failure ledger ---------------------------------------------------------------------------


def test_the_ledger_keeps_the_first_failure_and_turns_silence_into_a_watchdog_failure() -> None:
    ledger = FailureLedger()
    ledger.watch("a", deadline=10.0)
    ledger.watch("b", deadline=10.0)
    ledger.watch("c", deadline=10.0)
    ledger.report("a", TransferStage.RECEIVE, "connection reset")
    ledger.report("a", TransferStage.WATCHDOG, "late")
    ledger.complete("c")
    assert [(f.key, f.stage) for f in ledger.drain(now=5.0)] == [("a", TransferStage.RECEIVE)]
    assert ledger.drain(now=9.0) == []
    (late,) = ledger.drain(now=10.0)
    assert (late.key, late.stage) == ("b", TransferStage.WATCHDOG)
    assert ledger.drain(now=20.0) == [] and ledger.num_watched == 0


# -- kv_transfer_params -----------------------------------------------------------------------

CONSUMER: dict[str, Any] = {
    "do_remote_prefill": True,
    "remote_engine_id": "e1",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "remote_request_id": "t1",
    "remote_block_ids": [3, 4, 9],
}


def test_params_name_the_role() -> None:
    assert parse_kv_transfer_params(None) is None
    assert parse_kv_transfer_params({"do_remote_decode": False}) is None
    assert parse_kv_transfer_params({"do_remote_decode": True}) == ProducerParams()
    consumer = parse_kv_transfer_params(CONSUMER)
    assert isinstance(consumer, ConsumerParams) and consumer.remote_block_ids == (3, 4, 9)
    assert parse_kv_transfer_params(consumer.to_dict()) == consumer


@pytest.mark.parametrize(
    ("params", "key"),
    [
        ({"do_remote_decode": True, "do_remote_prefill": True}, "exclusive"),
        ({"do_remote_decode": "yes"}, "do_remote_decode"),
        ({"do_remote_decode": True, "remote_host": "x"}, "unknown keys"),
        ({**CONSUMER, "remote_port": 0}, "remote_port"),
        ({**CONSUMER, "remote_block_ids": [0, 1]}, "remote_block_ids"),
        ({**CONSUMER, "remote_request_id": ""}, "remote_request_id"),
        ({**CONSUMER, "extra": 1}, "unknown keys"),
    ],
)
def test_bad_params_name_the_key(params: dict[str, Any], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        parse_kv_transfer_params(params)


# -- control channel --------------------------------------------------------------------------


def test_control_channel_request_notify_and_a_dead_peer_times_out() -> None:
    from fleetserve.engine.kv_transfer.side_channel import (
        ControlClient,
        ControlServer,
        Handshake,
        HandshakeReply,
        Heartbeat,
    )

    seen: list[Any] = []
    got_heartbeat = threading.Event()

    def handler(message: Any) -> Any:
        seen.append(message)
        if isinstance(message, Handshake):
            return HandshakeReply(engine_id="p", compatibility_hash="h", compatibility_key={},
                                  lease_seconds=30.0, transport={})  # fmt: skip
        got_heartbeat.set()
        return None

    server = ControlServer("127.0.0.1", 0, handler)
    client = ControlClient(timeout_s=1.0)
    try:
        reply = client.request("127.0.0.1", server.port, Handshake(engine_id="c"))
        assert isinstance(reply, HandshakeReply) and reply.engine_id == "p"
        assert client.notify("127.0.0.1", server.port, Heartbeat(keys=["a", "b"]))
        assert got_heartbeat.wait(5)
        assert seen[-1] == Heartbeat(keys=["a", "b"])
        port = server.port
        server.close()
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="no reply"):
            client.request("127.0.0.1", port, Handshake(engine_id="c"))
        assert time.monotonic() - started < 3.0
    finally:
        client.close()
