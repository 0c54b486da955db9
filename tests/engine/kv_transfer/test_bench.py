"""`fleetserve bench kv-transfer` end to end on tiny sizes: one run, every row, checked bytes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetserve.bench.kv_transfer import SOCKET_ROW, main
from fleetserve.cli import build_parser


@pytest.mark.slow
def test_bench_prints_every_transport_memcpy_and_round_trips(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "kv.json"
    argv = ["--sizes-mib", "1,2", "--iterations", "2", "--rtt-iterations", "20", "--passes", "2"]
    argv += ["--json", str(out)]
    assert main(argv) == 0
    table = capsys.readouterr().out
    names = ("tcp", "tcp same-host (shm)", "mooncake (tcp)", "memcpy (1 thread)", SOCKET_ROW)
    for name in names:
        assert f"\n{name} " in table
    assert "1 MiB (32 blocks)" in table and "2 MiB (64 blocks)" in table
    assert "mooncake raw batch_transfer_sync_read" in table
    result = json.loads(out.read_text())
    assert result["layout"]["block_bytes"] == 32 * 1024
    rows = {row["name"]: row["gb_s"] for row in result["rows"]}
    assert all(value > 0 for gb_s in rows.values() for value in gb_s.values())
    assert set(result["ratios"]["1 MiB"]) == {
        "tcp_over_mooncake",
        "tcp_over_plain_socket",
        "same_host_over_memcpy",
    }
    assert set(result["rtt_us"]) == {
        "tcp",
        "tcp same-host (shm)",
        "mooncake (tcp)",
        "mooncake raw batch_transfer_sync_read",
    }


def test_bench_is_registered_and_checks_its_arguments() -> None:
    args = build_parser().parse_args(["bench", "kv-transfer", "--transports", "tcp,nixl"])
    with pytest.raises(ValueError, match=r"--transports: unknown \['nixl'\]"):
        args.func(args)
    args = build_parser().parse_args(["bench", "kv-transfer", "--iterations", "3"])
    with pytest.raises(ValueError, match="--iterations, --rtt-iterations >= --passes"):
        args.func(args)
