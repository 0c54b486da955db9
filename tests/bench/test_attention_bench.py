"""`fleetserve bench attention`: the steps it builds, and a line per step and backend."""

from __future__ import annotations

import pytest

from fleetserve.bench.attention import AttentionStep, prefill_step
from fleetserve.cli import main
from fleetserve.kernels.cpu.build import load_cpu_kernels


def test_a_prefill_step_holds_the_asked_tokens_in_prompts_of_the_asked_lengths() -> None:
    step = prefill_step(2048, 32, 512, seed=3)
    assert sum(step.query_lens) == 2048
    assert all(32 <= n <= 512 for n in step.query_lens[:-1])
    assert 1 <= step.query_lens[-1] <= 512
    assert step.context_lens == [0] * len(step.query_lens)
    with pytest.raises(ValueError, match="--min-prompt and --max-prompt"):
        prefill_step(64, 10, 5, seed=0)


def test_the_counted_work_is_causal_attention_over_each_rows_context() -> None:
    # Two new tokens after three cached ones: the rows see 4 and 5 keys.
    step = AttentionStep("prefill", [2], [3])
    assert step.flops(num_heads=4, head_size=32) == 4 * (4 + 5) * 4 * 32
    assert step.kv_bytes(num_kv_heads=2, head_size=32) == 2 * 5 * 2 * 32 * 4


def test_the_bench_times_each_backend_on_each_step(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["bench", "attention", "--shape", "tiny", "--prefill-tokens", "64", "--max-prompt",
            "40", "--decode-rows", "4", "--decode-context", "20", "--reps", "1"]  # fmt: skip
    assert main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("attention: tiny (4 heads, 2 KV heads of 32), float32, one layer")
    timed = [line.split() for line in lines[2:]]
    backends = {"torch"} | ({"cpu_paged"} if load_cpu_kernels().available else set())
    assert {(row[0], row[1]) for row in timed} == {
        (step, b) for step in ("prefill", "decode") for b in backends
    }
    assert all(float(row[2]) > 0 and row[3].endswith("x") for row in timed)
    assert {row[-1] for row in timed} == {"GFLOP/s", "GB/s"}
    assert main(["bench", "attention", "--shape", "tiny", "--backends", "flash"]) == 2
    assert "--backends must list some of" in capsys.readouterr().err
    assert main(["bench", "attention", "--shape", "tiny", "--decode-rows", "0"]) == 2
    assert "--decode-rows must be >= 1, got 0" in capsys.readouterr().err
