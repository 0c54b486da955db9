"""The drain's pure parts (`fleetserve.operator.drain`): when a drain is done or timed out, what
an engine's /metrics says is in flight (read from a real engine metrics registry served over
HTTP), and the Draining condition."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from fleetserve.api.labels import ANNOTATION_DRAIN_REASON, ANNOTATION_DRAINING_SINCE
from fleetserve.engine.metrics import EngineMetrics
from fleetserve.operator.drain import (
    DRAIN_SETTLE_S,
    DrainingGroup,
    drain_progress,
    draining_condition,
    draining_since,
    in_flight_from_metrics,
    probe_leader,
)

T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)


def _at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_a_drain_is_never_done_before_it_settled_and_the_probe_is_not_read_then() -> None:
    def never() -> int:
        raise AssertionError("probed before the drain settled")

    assert drain_progress(T0, _at(DRAIN_SETTLE_S - 0.5), 60, never) == ("draining", None)


def test_a_drain_is_done_at_zero_in_flight_and_waits_otherwise() -> None:
    assert drain_progress(T0, _at(DRAIN_SETTLE_S), 60, lambda: 0) == ("drained", 0)
    assert drain_progress(T0, _at(30), 60, lambda: 2) == ("draining", 2)
    assert drain_progress(T0, _at(30), 60, lambda: None) == ("draining", None)


def test_the_timeout_cuts_a_drain_short_but_a_clean_one_still_reads_drained() -> None:
    assert drain_progress(T0, _at(61), 60, lambda: 3) == ("timed-out", 3)
    assert drain_progress(T0, _at(61), 60, lambda: None) == ("timed-out", None)
    assert drain_progress(T0, _at(61), 60, lambda: 0) == ("drained", 0)
    # Timeout 0: deleted at the first look after the settle time.
    assert drain_progress(T0, _at(DRAIN_SETTLE_S), 0, lambda: 1) == ("timed-out", 1)


def test_drain_state_is_read_back_from_the_statefulset() -> None:
    def sts(annotations: dict[str, str]) -> dict[str, Any]:
        return {"metadata": {"annotations": annotations}}

    assert draining_since(sts({})) is None
    assert draining_since(sts({ANNOTATION_DRAINING_SINCE: "2026-12-01T12:00:00Z",
                               ANNOTATION_DRAIN_REASON: "roll"})) == (T0, "roll")  # fmt: skip
    # A hand-edited stamp: still draining, start unknown (the reconcile restamps it).
    assert draining_since(sts({ANNOTATION_DRAINING_SINCE: "yesterday"})) == (None, "scale-down")


def _engine_metrics_text(running: int, waiting: int, leases: int) -> str:
    registry = CollectorRegistry()
    metrics = EngineMetrics(registry, "m", kv_transfer=True)
    metrics.num_requests_running.set(running)
    metrics.num_requests_waiting.set(waiting)
    assert metrics.kv_transfer is not None
    metrics.kv_transfer.active_leases.set(leases)
    return generate_latest(registry).decode()


def test_in_flight_counts_running_waiting_and_producer_leases() -> None:
    assert in_flight_from_metrics(_engine_metrics_text(0, 0, 0)) == 0
    assert in_flight_from_metrics(_engine_metrics_text(2, 1, 4)) == 7
    with pytest.raises(ValueError, match="no request or lease gauges"):
        in_flight_from_metrics("# nothing\nother_metric 1\n")


@pytest.fixture
def metrics_server() -> Iterator[tuple[str, list[str]]]:
    """A real HTTP server whose GET /metrics answers the text in body[0]."""
    body = [""]

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            data = body[0].encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield str(server.server_address[1]), body
    finally:
        server.shutdown()
        server.server_close()


def _pod(phase: str = "Running", ip: str | None = "127.0.0.1", index: str = "0") -> dict[str, Any]:
    return {
        "metadata": {"name": f"g-{index}", "labels": {"apps.kubernetes.io/pod-index": index}},
        "status": {"phase": phase, **({"podIP": ip} if ip else {})},
    }


def test_the_probe_reads_the_leader_over_http(metrics_server: tuple[str, list[str]]) -> None:
    port, body = metrics_server
    body[0] = _engine_metrics_text(1, 0, 2)
    # The leader (pod index 0) is read, not the follower listed first.
    follower = _pod(ip="127.0.0.250", index="1")
    assert probe_leader([follower, _pod()], int(port)) == 3
    body[0] = _engine_metrics_text(0, 0, 0)
    assert probe_leader([_pod()], int(port)) == 0
    body[0] = "not prometheus {{{"
    assert probe_leader([_pod()], int(port)) is None


def test_an_engine_that_does_not_listen_has_nothing_in_flight() -> None:
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert probe_leader([_pod()], port) == 0
    assert probe_leader([], port) == 0
    assert probe_leader([_pod(phase="Pending")], port) == 0
    assert probe_leader([_pod(ip=None)], port) == 0


def test_the_draining_condition_says_what_why_since_and_until_when() -> None:
    groups = [
        DrainingGroup("prefill", 0, T0, "roll", 600),
        DrainingGroup("decode", 1, T0, "scale-down", 0),
    ]
    c = draining_condition(groups)
    assert (c.status, c.reason) == ("True", "Draining")
    assert c.message == (
        "decode group 1 (scale-down) since 2026-12-01T12:00:00Z, deleted by"
        " 2026-12-01T12:00:05Z at the latest;"
        " prefill group 0 (roll) since 2026-12-01T12:00:00Z, deleted by"
        " 2026-12-01T12:10:00Z at the latest"
    )
    c = draining_condition([])
    assert (c.status, c.reason, c.message) == ("False", "NoDrain", "no group drains")


def test_a_draining_deployment_is_reconciled_again_by_a_timer_no_success_cancels() -> None:
    """`Retries.later` (how the handlers requeue a deployment while a group drains): it runs
    once after its delay, a newer one replaces it, and the same key's successful work (the
    reconcile that asked for it) does not cancel it."""
    from fleetserve.operator.retries import Retries

    retries = Retries()
    ran: list[str] = []
    done = threading.Event()
    try:
        retries.later("requeue ns/x", 0.05, lambda: ran.append("old"))
        retries.later("requeue ns/x", 0.05, lambda: (ran.append("new"), done.set()))
        retries.run("requeue ns/x", lambda: None)  # a success of that key
        assert done.wait(5)
        time.sleep(0.1)
        assert ran == ["new"]
    finally:
        retries.close()
    retries.later("requeue ns/x", 0.01, lambda: ran.append("after close"))
    time.sleep(0.05)
    assert ran == ["new"]
