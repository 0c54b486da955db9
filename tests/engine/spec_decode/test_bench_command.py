"""`fleetserve bench spec-decode` runs both workloads and prints both engines side by side
(a smoke run on a tiny model; the figures come from running the command, not from tests)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetserve.bench.spec_decode import main
from tests.engine.tiny_models import make_tiny_model


def test_the_bench_prints_plain_and_speculative_rows(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The tiny tokenizer is byte-level: the chat tasks need room.
    model = make_tiny_model(tmp_path, "llama", max_position_embeddings=1024)
    args = ["--model", str(model), "--num-prompts", "2", "--output-len", "8"]
    assert main([*args, "--random-input-len", "16"]) == 0  # 0: the greedy tokens matched
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0].split()[:3] == ["workload", "engine", "tok/s"]
    rows = [line.split() for line in lines[1:]]
    assert [(r[0], r[1]) for r in rows] == [
        ("repetitive", "plain"), ("repetitive", "ngram"),
        ("random", "plain"), ("random", "ngram"),
    ]  # fmt: skip
    assert rows[1][-1] == "yes" and rows[3][-1] == "sampled"
