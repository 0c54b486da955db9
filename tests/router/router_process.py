"""A real `python -m fleetserve router` process over given engines (`start_router`), for the
end-to-end tests; a helper module, not a conftest, so tests import it by name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from fleetserve.common.ports import free_port
from tests.server.server_process import API_KEY, REPO_ROOT, stop, wait_healthy


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


def start_router(
    log_path: Path, *args: str, ready_timeout_s: float = 120
) -> Iterator[RouterHandle]:
    """Run the router with `args` (plus host, port and the engines' API key) until the generator
    is closed; yields once its /health is 200 (one generation went through the fleet)."""
    port = free_port()
    log = log_path.open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "fleetserve", "router", "--host", "127.0.0.1", "--port", str(port),
         "--engine-api-key", API_KEY, "--scrape-interval-s", "0.2", *args],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    handle = RouterHandle(f"http://127.0.0.1:{port}", process, log_path)
    try:
        wait_healthy(
            process, handle.base_url, log_path, "router", timeout_s=ready_timeout_s, interval_s=0.2
        )
        yield handle
    finally:
        stop(process, grace_s=15)
        log.close()


def complete_tokens(router: RouterHandle, prompt: Any, stream: bool, max_tokens: int) -> list[int]:
    """A greedy completion through the router (`ignore_eos`), streamed or not: its token ids.
    A stream must end with `[DONE]` and carry no error event."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "return_token_ids": True, "stream": stream}  # fmt: skip
    response = requests.post(f"{router.base_url}/v1/completions", json=body, stream=stream,
                             timeout=120)  # fmt: skip
    assert response.status_code == 200, response.text
    if not stream:
        return list(response.json()["choices"][0]["token_ids"])
    tokens: list[int] = []
    events = [line for line in response.iter_lines() if line.startswith(b"data: ")]
    assert events[-1] == b"data: [DONE]", events[-1]
    for line in events[:-1]:
        event = json.loads(line[6:])
        assert "error" not in event, event
        tokens += event["choices"][0]["token_ids"] or []
    return tokens
