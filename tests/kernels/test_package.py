"""The kernels package imports without triton; the benchmark's CPU smoke run prints its table."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch


def test_package_import_does_not_import_triton() -> None:
    code = (
        "import sys, fleetserve.kernels as k; "
        "assert 'triton' not in sys.modules, 'triton imported eagerly'; "
        "assert callable(k.is_interpreter)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="the GPU run is fleetserve/bench/gpu_check.sh"
)
def test_bench_smoke_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from fleetserve.kernels.bench import main

    out = tmp_path / "bench.json"
    main(["--smoke", "--json", str(out)])
    table = capsys.readouterr().out
    assert table.startswith("device: cpu (Triton interpreter)")
    rows = json.loads(out.read_text())["rows"]
    names = [row["name"] for row in rows]
    assert names == [
        *["attention"] * 4,
        "rms_norm+residual",
        "silu_and_mul",
        "rotary (neox)",
        "reshape_and_cache",
        "fused_moe",
    ]
    assert [row["config"].split(" T=")[0] for row in rows[:4]] == ["mixed", *["decode"] * 3]
    assert [" splits=" in row["config"] for row in rows[:4]] == [False, False, True, True]
    assert all(row["triton_ms"] > 0 and row["torch_ms"] > 0 for row in rows)
    assert len(table.splitlines()) == 2 + len(rows)
