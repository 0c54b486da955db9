"""A real `python -m fleetserve.server` process on the bundled model (`start_server`), for the
end-to-end tests; a helper module, not a conftest, so tests import it by name."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import requests

from fleetserve.common.ports import free_port

API_KEY = "test-key"
MAX_MODEL_LEN = 512
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class ServerHandle:
    base_url: str
    process: subprocess.Popen[bytes]
    log_path: Path
    model_path: str
    model_name: str

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {API_KEY}"}

    def engine_core_pid(self) -> int:
        match = re.search(r"engine core process (\d+) ready", self.log_path.read_text())
        assert match, "the server did not log its engine core pid"
        return int(match.group(1))

    def metrics(self) -> dict[str, float]:
        """Sample name (with labels stripped) → value, from GET /metrics."""
        text = requests.get(f"{self.base_url}/metrics", timeout=10).text
        values: dict[str, float] = {}
        for line in text.splitlines():
            if line.startswith("#") or not line.strip():
                continue
            name_labels, value = line.rsplit(" ", 1)
            name = name_labels.split("{", 1)[0]
            labels = name_labels[len(name) :]
            key = name if "le=" not in labels else f"{name}{labels}"
            values[key] = float(value)
        return values


def wait_healthy(
    process: subprocess.Popen[bytes],
    base_url: str,
    log_path: Path,
    what: str,
    *,
    timeout_s: float,
    interval_s: float,
) -> None:
    """Poll `base_url`/health until it answers 200; fail with the log's tail if `process` exits
    or the timeout passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, f"{what} exited:\n{log_path.read_text()[-3000:]}"
        assert time.monotonic() < deadline, (
            f"{what} not healthy in {timeout_s} s:\n{log_path.read_text()[-3000:]}"
        )
        try:
            if requests.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(interval_s)


def stop(process: subprocess.Popen[bytes], *, grace_s: float) -> None:
    """SIGINT (a clean shutdown), then SIGKILL after `grace_s`."""
    process.send_signal(signal.SIGINT)
    try:
        process.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def start_server(
    tmp_path: Path, *extra_args: str, model: str | None = None, max_model_len: int = MAX_MODEL_LEN
) -> Iterator[ServerHandle]:
    """Serve `model` (default: the bundled SmolLM2) until the generator is closed."""
    if model is None:
        from fleetserve.engine.models.bundled import bundled_model_path

        model = str(bundled_model_path())
    port = free_port()
    log_path = tmp_path / "server.log"
    log = log_path.open("wb")
    process = subprocess.Popen(
        [sys.executable, "-m", "fleetserve.server", model, "--port", str(port),
         "--max-model-len", str(max_model_len), "--api-key", API_KEY,
         "--stats-log-interval", "1", *extra_args],
        stdout=log, stderr=subprocess.STDOUT, cwd=REPO_ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    handle = ServerHandle(f"http://127.0.0.1:{port}", process, log_path, model, Path(model).name)
    try:
        wait_healthy(process, handle.base_url, log_path, "server", timeout_s=300, interval_s=0.5)
        yield handle
    finally:
        stop(process, grace_s=30)
        log.close()
