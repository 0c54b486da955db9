"""The local node agent's record of live container processes (`<state-dir>/pods.json`).

The agent rewrites it whenever it starts or stops a container process. `down` reads it after
stopping the agent, to kill any process group the agent could not (e.g. it was SIGKILLed).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from fleetserve.devcluster.processes import ProcessRecord, stop

__all__ = ["kill_recorded_pods", "load_pod_records", "save_pod_records"]

RECORDS_FILE = "pods.json"


def save_pod_records(state_dir: Path, records: Iterable[ProcessRecord]) -> None:
    """Atomically replace the record with `records`."""
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / (RECORDS_FILE + ".tmp")
    tmp.write_text(json.dumps([r.to_json() for r in records], indent=2))
    tmp.replace(state_dir / RECORDS_FILE)


def load_pod_records(state_dir: Path) -> list[ProcessRecord]:
    path = state_dir / RECORDS_FILE
    if not path.exists():
        return []
    return [ProcessRecord.from_json(r) for r in json.loads(path.read_text())]


def kill_recorded_pods(state_dir: Path, *, timeout_s: float = 5.0) -> list[str]:
    """Stop every recorded process group still alive; returns their names."""
    killed = []
    for record in load_pod_records(state_dir):
        if record.is_alive():
            killed.append(record.name)
            stop(record, timeout_s=timeout_s)
    return killed
