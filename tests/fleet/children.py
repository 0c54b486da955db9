"""Small real child processes for the supervisor tests (python -c programs), and a driver that
runs `Supervisor.run` in a process of its own so that a test can signal or kill it."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

PY = sys.executable
ROOT = Path(__file__).resolve().parents[2]


def with_grandchild() -> list[str]:
    """Prints `pids <self> <grandchild>`, then sleeps; its own child sleeps too."""
    code = (
        "import os, subprocess, sys, time\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        "print(f'pids {os.getpid()} {g.pid}', flush=True)\n"
        "time.sleep(600)\n"
    )
    return [PY, "-c", code]


def sleeper() -> list[str]:
    """Prints `pids <self>`, then sleeps."""
    return [PY, "-c", "import os, time; print(f'pids {os.getpid()}', flush=True); time.sleep(600)"]


def ignores_sigterm() -> list[str]:
    code = (
        "import os, signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print(f'pids {os.getpid()}', flush=True)\n"
        "time.sleep(600)\n"
    )
    return [PY, "-c", code]


def prints(
    text: str, *, stderr: bool = False, then_exit: int | None = None, after_s: float = 0.0
) -> list[str]:
    stream = "sys.stderr" if stderr else "sys.stdout"
    end = (
        f"time.sleep({after_s}); sys.exit({then_exit})"
        if then_exit is not None
        else "time.sleep(600)"
    )
    code = f"import sys, time\nprint({text!r}, file={stream}, flush=True)\n{end}\n"
    return [PY, "-c", code]


def health_server(port: int, healthy_after_s: float = 0.0) -> list[str]:
    """An HTTP server on 127.0.0.1:port whose /health answers 503, then 200 after a delay."""
    code = (
        "import http.server, sys, time\n"
        f"start, delay = time.monotonic(), {healthy_after_s}\n"
        "class H(http.server.BaseHTTPRequestHandler):\n"
        "    def do_GET(self):\n"
        "        ok = self.path == '/health' and time.monotonic() - start >= delay\n"
        "        self.send_response(200 if ok else 503)\n"
        "        self.end_headers()\n"
        "    def log_message(self, *args):\n"
        "        pass\n"
        f"http.server.HTTPServer(('127.0.0.1', {port}), H).serve_forever()\n"
    )
    return [PY, "-c", code]


def alive(pid: int) -> bool:
    """The process exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def wait_gone(pids: list[int], timeout_s: float = 10.0) -> list[int]:
    """The pids still alive after up to `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    left = [p for p in pids if alive(p)]
    while left and time.monotonic() < deadline:
        time.sleep(0.05)
        left = [p for p in left if alive(p)]
    return left


def driver_argv(stages: list[list[dict[str, object]]], **settings: float) -> list[str]:
    """`python -c` running `Supervisor(stages, **settings).run()`, printing `[up] READY` once up."""
    spec = json.dumps({"stages": stages, "settings": settings})
    code = (
        "import json, sys\n"
        "from fleetserve.fleet.supervisor import Child, Supervisor\n"
        f"spec = json.loads({spec!r})\n"
        "stages = [[Child(**c) for c in stage] for stage in spec['stages']]\n"
        "sup = Supervisor(stages, **spec['settings'])\n"
        "sys.exit(sup.run(lambda s: s.say('READY')))\n"
    )
    return [PY, "-c", code]


def driver_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
