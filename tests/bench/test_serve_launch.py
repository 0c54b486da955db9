"""`bench serve --launch`: the server commands and the side-by-side table (no servers started)."""

from __future__ import annotations

import argparse
import sys

import pytest

from fleetserve.bench.serve import add_arguments
from fleetserve.bench.serve_launch import Row, format_rows, server_command


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_commands_serve_the_same_model_on_the_given_port() -> None:
    args = _args("--launch", "fleetserve,vllm", "--vllm-python", sys.executable)
    ours = server_command("fleetserve", "/m", 8123, args)
    assert ours[1:4] == ["-m", "fleetserve", "serve"] and "/m" in ours and "8123" in ours
    peer = server_command("vllm", "/m", 8124, args)
    assert "vllm.entrypoints.openai.api_server" in peer
    assert peer[peer.index("--kv-cache-memory-bytes") + 1] == str(1 << 30)
    with pytest.raises(ValueError, match="--launch entries must be fleetserve or vllm"):
        server_command("sglang", "/m", 1, args)


def test_vllm_without_a_side_venv_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FLEETSERVE_VLLM_PYTHON", raising=False)
    with pytest.raises(ValueError, match="--launch vllm needs --vllm-python"):
        server_command("vllm", "/m", 1, _args("--launch", "vllm"))


def test_table_gives_fleetserve_ratios_per_concurrency() -> None:
    rows = [
        Row("fleetserve", 16, 300.0, 80.0, 50.0),
        Row("fleetserve", 32, 400.0, 120.0, 70.0),
        Row("vllm", 16, 200.0, 100.0, 100.0),
        Row("vllm", 32, 500.0, 60.0, 70.0),
    ]
    lines = format_rows(rows).splitlines()
    assert lines[3].split()[-3:] == ["1.50", "0.80", "0.50"]
    assert lines[4].split()[-3:] == ["0.80", "2.00", "1.00"]
    assert len(lines[1].split()) == 5  # fleetserve's own rows carry no ratio
