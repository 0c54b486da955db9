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
        Row("fleetserve", 16, 300.0, 80.0, 50.0, 0.25),
        Row("fleetserve", 32, 400.0, 120.0, 70.0),
        Row("vllm", 16, 200.0, 100.0, 100.0),
        Row("vllm", 32, 500.0, 60.0, 70.0),
    ]
    lines = format_rows(rows).splitlines()
    assert lines[3].split()[-3:] == ["1.50", "0.80", "0.50"]
    assert lines[4].split()[-3:] == ["0.80", "2.00", "1.00"]
    assert lines[1].split() == ["fleetserve", "16", "300.0", "80.0", "50.0", "25.0%"]
    assert lines[2].split()[-1] == "-"  # no roofline measured; fleetserve's rows carry no ratio


def test_serving_roofline_is_the_slower_of_compute_and_weight_reads() -> None:
    from fleetserve.bench.roofline import Roofline

    roofline = Roofline(bandwidth_gb_s=10.0, gemm_gflop_s=100.0)
    # 1e8 weights (4e8 bytes): each decode step reads them in 0.04 s.
    compute = roofline.serving_seconds(400_000_000, 100_000_000, 50_000, 32, 16, 5)
    assert compute == pytest.approx(2 * 1e8 * 50_000 / 1e11)  # 100 s of GEMM > 2 × 4 × 0.04 s
    reads = roofline.serving_seconds(400_000_000, 100_000_000, 10, 32, 16, 65)
    assert reads == pytest.approx(2 * 64 * 0.04)  # two waves of 64 decode steps
