"""`fleetserve bench offline --repeats N`: every engine runs the timed workload N times and is
scored by its median run."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetserve.bench.offline import Result, Workload, format_table, timed_runs
from fleetserve.cli import main
from tests.engine.tiny_models import make_tiny_model


def test_timed_runs_times_each_call_and_returns_the_last_result() -> None:
    calls: list[int] = []

    def run() -> int:
        calls.append(len(calls))
        return len(calls)

    runs, last = timed_runs(3, run)
    assert len(runs) == 3 and all(r >= 0 for r in runs)
    assert calls == [0, 1, 2] and last == 3
    with pytest.raises(ValueError, match="--repeats must be at least 1, got 0"):
        timed_runs(0, run)


def test_a_reset_runs_before_every_timed_run_and_must_succeed() -> None:
    events: list[str] = []

    def reset() -> bool:
        events.append("reset")
        return True

    timed_runs(2, lambda: events.append("run"), reset)
    assert events == ["reset", "run", "reset", "run"]
    with pytest.raises(RuntimeError, match="prefix cache could not be reset"):
        timed_runs(1, lambda: None, lambda: False)


def test_with_the_reset_no_repeat_finds_its_prompts_in_the_prefix_cache(tmp_path: Path) -> None:
    from fleetserve import LLM, SamplingParams

    llm = LLM(str(make_tiny_model(tmp_path, "llama")), dtype="float32")
    prompts = [{"prompt_token_ids": [100 + i] * 40} for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
    manager = llm.engine_core.scheduler.kv_cache_manager
    timed_runs(3, lambda: llm.generate(prompts, params), llm.reset_prefix_cache)
    assert manager.prefix_cache_hits == 0
    timed_runs(2, lambda: llm.generate(prompts, params))  # the control: repeats do hit
    assert manager.prefix_cache_hits > 0


def test_an_engine_is_scored_by_its_median_run() -> None:
    workload = Workload([[1, 2, 3], [4, 5]], output_len=4)
    result = Result("e", (3.0, 1.0, 2.5), 8, workload.num_prompt_tokens)
    assert result.seconds == 2.5
    assert result.runs_s == (3.0, 1.0, 2.5)
    assert result.output_tokens_per_s == 8 / 2.5
    assert result.prompt_tokens == 5


def test_the_ratio_column_is_against_fleetserve_or_else_the_first_engine() -> None:
    workload = Workload([[1, 2, 3], [4, 5]], output_len=4)
    sync, fast, slow = (Result(name, (s,), 8, 5) for name, s in
                        (("fleetserve-sync", 2.0), ("fleetserve", 1.0), ("vllm", 4.0)))  # fmt: skip

    def ratios(table: str) -> dict[str, float]:
        rows = table.splitlines()[2:]
        return {row.split()[0]: float(row.split()[-1]) for row in rows}

    with_fleetserve = format_table([sync, fast, slow], workload)
    assert "fleetserve ×" in with_fleetserve.splitlines()[1]
    # How many times the base's throughput each engine's is: vLLM took four times as long.
    assert ratios(with_fleetserve) == {"fleetserve-sync": 2.0, "fleetserve": 1.0, "vllm": 4.0}
    without = format_table([sync, slow], workload)
    assert "fleetserve-sync ×" in without.splitlines()[1]
    assert ratios(without) == {"fleetserve-sync": 1.0, "vllm": 2.0}


def test_bench_offline_repeats_fleetserves_run_and_reports_the_median(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = make_tiny_model(tmp_path, "llama")
    out = tmp_path / "result.json"
    argv = ["bench", "offline", "--model", str(model), "--engines", "fleetserve"]
    argv += ["--num-prompts", "4", "--min-input", "8", "--max-input", "16", "--output-len", "3"]
    argv += ["--repeats", "3", "--output-json", str(out)]
    assert main(argv) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert len(result["runs_s"]) == 3
    assert result["seconds"] == sorted(result["runs_s"])[1]
    assert result["output_tokens"] == 4 * 3
    printed = capsys.readouterr().out
    assert "runs: " in printed and "median s" in printed
