"""`fleetserve bench gemm`: the GEMMs it times are the engine model's, and it prints a line per
row count and implementation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fleetserve.bench.decode import SHAPES, weight_count, write_shape_folder
from fleetserve.bench.offline import layer_shapes
from fleetserve.cli import main
from fleetserve.engine.config import EngineConfig
from fleetserve.engine.layers.gemm import onednn_supports
from fleetserve.kernels.cpu.ops import small_gemm_supported
from tests.engine.tiny_models import load_engine_model


@pytest.mark.parametrize("shape", ["tiny", "smollm2-135m"])
def test_a_step_multiplies_through_the_models_weights(tmp_path: Path, shape: str) -> None:
    config = SHAPES[shape]
    model = load_engine_model(
        EngineConfig.create(str(write_shape_folder(shape, tmp_path)), load_format="dummy")
    )
    layers, hidden = config["num_hidden_layers"], config["hidden_size"]
    per_layer = sum(n * k for n, k in layer_shapes(config))
    head = config["vocab_size"] * hidden
    norms = (2 * layers + 1) * hidden  # the RMSNorm weights: multiplied, but not by a GEMM
    assert per_layer * layers + head + norms == weight_count(model)


def test_the_bench_times_each_implementation_at_each_row_count(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "gemm", "--shape", "tiny", "--rows", "1,5", "--reps", "1"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("gemm: tiny, 2 layers + LM head, 9 GEMMs")
    timed = [line.split() for line in lines if line.split()[:1] in (["1"], ["5"])]
    names = {"mkl", "onednn-plain", "onednn"} | ({"small"} if small_gemm_supported() else set())
    assert {(row[0], row[1]) for row in timed} == {(r, n) for r in ("1", "5") for n in names}
    assert all(float(row[2]) > 0 and row[4].endswith("x") for row in timed)
    assert main(["bench", "gemm", "--shape", "tiny", "--rows", "0"]) == 2
    assert "--rows must be positive integers" in capsys.readouterr().err


def test_the_bench_times_bfloat16_with_its_own_kernel(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["bench", "gemm", "--shape", "tiny", "--rows", "3", "--reps", "1", "--dtype", "bfloat16"]
    assert main(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "MB of bfloat16 weights" in lines[0]
    names = {line.split()[1] for line in lines if line.split()[:1] == ["3"]}
    small = {"small"} if small_gemm_supported(torch.bfloat16) else set()
    # oneDNN computes bfloat16 only with AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT.
    onednn = {"onednn-plain", "onednn"} if onednn_supports(torch.bfloat16) else set()
    assert names == {"mkl"} | onednn | small
