"""The Kubernetes pod watch (`fleetserve.router.discovery`) with the real `kubernetes` client
against a small scripted API server over HTTP (list, then a watch stream of events): pods that
become Ready join the fleet without a restart, deleted ones leave, a broken watch relists. (The
dev-cluster test runs it against a real kube-apiserver.)"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from prometheus_client import CollectorRegistry

from fleetserve.api.labels import LABEL_COMPAT, LABEL_ROLE
from fleetserve.api.router_config import RouterConfig
from fleetserve.router.discovery import run_discovery
from fleetserve.router.fleet import Fleet
from fleetserve.router.metrics import RouterMetrics


def _pod(name: str, ip: str, ready: bool, role: str = "decode") -> dict[str, Any]:
    return {
        "metadata": {"name": name, "namespace": "ns", "resourceVersion": "5",
                     "labels": {LABEL_ROLE: role, LABEL_COMPAT: "h"}},
        "status": {"podIP": ip, "conditions": [{"type": "Ready",
                                                "status": "True" if ready else "False"}]},
    }  # fmt: skip


class FakeApiServer:
    """GET /api/v1/namespaces/ns/pods: a PodList, or with ?watch=true a stream of the events
    put in `events[selector]` (None ends the stream)."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.events: dict[str, asyncio.Queue[dict[str, Any] | None]] = {}
        self.selectors: list[str] = []
        self.lists = 0

    def queue(self, selector: str) -> asyncio.Queue[dict[str, Any] | None]:
        return self.events.setdefault(selector, asyncio.Queue())

    async def pods_handler(self, request: web.Request) -> web.StreamResponse:
        selector = request.query.get("labelSelector", "")
        self.selectors.append(selector)
        queue = self.queue(selector)
        if request.query.get("watch") not in ("true", "True", "1"):
            self.lists += 1
            return web.json_response({"kind": "PodList", "apiVersion": "v1",
                                      "metadata": {"resourceVersion": "5"},
                                      "items": list(self.pods.values())})  # fmt: skip
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        while (event := await queue.get()) is not None:
            obj = event["object"]
            if event["type"] == "DELETED":
                self.pods.pop(obj["metadata"]["name"], None)
            else:
                self.pods[obj["metadata"]["name"]] = obj
            await response.write(json.dumps(event).encode() + b"\n")
        return response

    async def serve(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> web.AppRunner:
        """Serve on a loopback port and point KUBECONFIG at it (the caller cleans the runner
        up); the kubernetes client then talks to this server as to an API server."""
        app = web.Application()
        app.router.add_get("/api/v1/namespaces/ns/pods", self.pods_handler)
        runner = web.AppRunner(app)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        port = runner.addresses[0][1]
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "t",
            "clusters": [{"name": "t", "cluster": {"server": f"http://127.0.0.1:{port}"}}],
            "contexts": [{"name": "t", "context": {"cluster": "t", "user": "t"}}],
            "users": [{"name": "t", "user": {"token": "x"}}],
        }))  # fmt: skip
        monkeypatch.setenv("KUBECONFIG", str(kubeconfig))
        monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        return runner


def test_pods_join_and_leave_the_fleet_as_they_become_ready_or_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def main() -> None:
        api = FakeApiServer()
        api.pods = {"d-0": _pod("d-0", "10.1.0.1", True), "d-1": _pod("d-1", "10.1.0.2", False)}
        runner = await api.serve(tmp_path, monkeypatch)
        config = RouterConfig(namespace="ns", prefill_selector="r=p", decode_selector="r=d",
                              compatibility_hash="h", engine_port=8000)  # fmt: skip
        fleet = Fleet(config, RouterMetrics(CollectorRegistry()))
        task = asyncio.create_task(run_discovery(config, fleet))

        async def until(done: Callable[[], bool], what: object) -> None:
            deadline = time.monotonic() + 10
            while not done():
                assert time.monotonic() < deadline, what
                await asyncio.sleep(0.02)

        async def engines(want: set[str]) -> None:
            decode = lambda: {u for u, e in fleet.engines.items() if e.role == "decode"}  # noqa: E731
            await until(lambda: decode() == want, (sorted(fleet.engines), want))

        try:
            await engines({"http://10.1.0.1:8000"})
            # Each selector is watched from its own thread, so the prefill list can come after
            # the decode pods have joined: wait for it, bounded.
            await until(lambda: "r=p" in api.selectors, api.selectors)
            assert "r=d" in api.selectors
            assert fleet.engines["http://10.1.0.1:8000"].compatibility_hash == "h"
            # Scale out: d-1 turns Ready, and a new pod d-2 arrives Ready.
            await api.queue("r=d").put(
                {"type": "MODIFIED", "object": _pod("d-1", "10.1.0.2", True)}
            )
            await api.queue("r=d").put({"type": "ADDED", "object": _pod("d-2", "10.1.0.3", True)})
            await engines({"http://10.1.0.1:8000", "http://10.1.0.2:8000", "http://10.1.0.3:8000"})
            await api.queue("r=d").put({"type": "DELETED", "object": _pod("d-0", "10.1.0.1", True)})
            await engines({"http://10.1.0.2:8000", "http://10.1.0.3:8000"})
            # The watch stream ends (as at its timeout or a dropped connection): relisted,
            # and what changed meanwhile is seen.
            lists = api.lists
            api.pods["d-3"] = _pod("d-3", "10.1.0.4", True)
            await api.queue("r=d").put(None)
            await engines({"http://10.1.0.2:8000", "http://10.1.0.3:8000", "http://10.1.0.4:8000"})
            assert api.lists > lists
        finally:
            task.cancel()
            for queue in api.events.values():
                await queue.put(None)
            await asyncio.gather(task, return_exceptions=True)
            await runner.cleanup()

    asyncio.run(main())
