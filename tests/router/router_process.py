"""A real `python -m fleetserve router` process over given engines (`start_router`), for the
end-to-end tests; a helper module, not a conftest, so tests import it by name."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import requests

from tests.server.server_process import API_KEY, REPO_ROOT


@dataclass
class RouterHandle:
    base_url: str
    process: subprocess.Popen[bytes]
    log_path: Path

    def metric(self, name: str, **labels: str) -> float:
        """One sample's value from GET /metrics (0 when absent)."""
        from prometheus_client.parser import text_string_to_metric_families

        text = requests.get(f"{self.base_url}/metrics", timeout=10).text
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name == name and all(
                    sample.labels.get(k) == v for k, v in labels.items()
                ):
                    return float(sample.value)
        return 0.0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_router(
    log_path: Path, *args: str, ready_timeout_s: float = 120
) -> Iterator[RouterHandle]:
    """Run the router with `args` (plus host, port and the engines' API key) until the generator
    is closed; yields once its /health is 200 (one generation went through the fleet)."""
    port = _free_port()
    log = log_path.open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "fleetserve", "router", "--host", "127.0.0.1", "--port", str(port),
         "--engine-api-key", API_KEY, "--scrape-interval-s", "0.2", *args],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    handle = RouterHandle(f"http://127.0.0.1:{port}", process, log_path)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            assert process.poll() is None, f"router exited:\n{log_path.read_text()[-3000:]}"
            assert time.monotonic() < deadline, (
                f"router not ready in {ready_timeout_s} s:\n{log_path.read_text()[-3000:]}"
            )
            try:
                if requests.get(f"{handle.base_url}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            time.sleep(0.2)
        yield handle
    finally:
        process.send_signal(signal.SIGINT)
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        log.close()
