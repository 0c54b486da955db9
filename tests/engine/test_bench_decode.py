"""`fleetserve bench decode` on the CPU with the tiny shape: the table, the JSON and the roofline."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetserve.bench.decode import SHAPES, main, weight_bytes_per_step, write_shape_folder
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
    with pytest.raises(ValueError, match="--modes must list 'graphs' and/or 'eager'"):
        main(["--shape", "tiny", "--device", "cpu", "--modes", "graphs,turbo"])
    with pytest.raises(ValueError, match="shape must be one of"):
        write_shape_folder("llama-9000", tmp_path)
