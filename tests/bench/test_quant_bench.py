"""`fleetserve bench quant` on a tiny model: one row per engine, the baseline agreeing with itself,
int8 holding a quarter of the linear weights; the command prints both rows side by side."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from fleetserve.bench import quant
from tests.engine.tiny_models import make_tiny_model


@pytest.mark.slow
def test_the_bench_prints_fp32_and_int8_side_by_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_model(tmp_path, "llama")
    parser = argparse.ArgumentParser()
    quant.add_arguments(parser)
    args = parser.parse_args(["--model", str(model), "--steps", "2", "--batch-sizes", "1",
                              "--input-len", "4", "--device", "cpu", "--text", quant.FIXED_TEXT[:120], "--json",
                              str(tmp_path / "rows.json")])  # fmt: skip
    assert quant.run_from_args(args) == 0
    out = capsys.readouterr().out
    fp32_line = next(line for line in out.splitlines() if line.startswith("fp32 "))
    int8_line = next(line for line in out.splitlines() if line.startswith("int8 "))
    assert "100.0%" in fp32_line
    fp32_linear, int8_linear = (float(line.split()[3]) for line in (fp32_line, int8_line))
    assert int8_linear < 0.27 * fp32_linear
    assert (tmp_path / "rows.json").is_file()
