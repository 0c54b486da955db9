"""Async scheduling (step N + 1 scheduled while step N runs) gives exactly the synchronous
engine's tokens: greedy and seeded, with requests ending at different lengths, aborts, preemption
under a small KV cache, prefix caching, chunked prefill next to decodes, and the synchronous
fall-back for structured output; speculative decoding and the other engines that cannot run it
refuse the flag by name.

Each test runs the same requests through a synchronous and an asynchronous engine on a tiny
random-weight model and compares token ids (bit-exact), checking the scheduler's invariants
after every step of the async one.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest

from fleetserve import LLM, SamplingParams
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.config import EngineConfig
from fleetserve.engine.core.engine_core import EngineCore
from fleetserve.engine.core.outputs import EngineCoreOutput
from fleetserve.engine.structured_output.params import StructuredOutputsParams
from tests.engine.tiny_models import make_tiny_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def _prompts(num: int, length: int = 9) -> list[list[int]]:
    return [[(7 * i + j) % 500 + 3 for j in range(length + i)] for i in range(num)]


def _core(model_dir: Path, async_scheduling: bool, **kwargs: Any) -> EngineCore:
    kwargs.setdefault("dtype", "float32")
    kwargs.setdefault("max_model_len", 256)
    config = EngineConfig.create(
        str(model_dir), device="cpu", async_scheduling=async_scheduling, **kwargs
    )
    assert config.scheduler.async_scheduling is async_scheduling
    return EngineCore(config)


def _run(
    core: EngineCore, abort_at: dict[str, int] | None = None, max_steps: int = 2000
) -> dict[str, list[int]]:
    """Step until done (aborting request `r` once it got `abort_at[r]` tokens, as a client
    that disconnects); the tokens per request."""
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        for req_id, num in (abort_at or {}).items():
            if len(tokens.get(req_id, [])) >= num:
                core.abort_requests([req_id])
        if not core.has_unfinished_requests():
            assert core.make_stats().kv_cache_usage == 0.0, "blocks left after the last request"
            return tokens
        outputs: list[EngineCoreOutput] = core.step()
        for output in outputs:
            tokens.setdefault(output.req_id, []).extend(output.new_token_ids)
        core.scheduler.check_invariants()
        for request in core.scheduler.running:
            if request.max_tokens is not None:
                assert request.num_output_tokens <= request.max_tokens, request
    raise AssertionError("requests did not finish")


def _both(
    model_dir: Path,
    requests: list[tuple[list[int], SamplingParams]],
    abort_at: dict[str, int] | None = None,
    **kwargs: Any,
) -> tuple[dict[str, list[int]], EngineCore]:
    """Run `requests` synchronously and asynchronously; assert equal tokens; return them."""
    results = []
    cores = []
    for async_scheduling in (False, True):
        core = _core(model_dir, async_scheduling, **kwargs)
        for i, (prompt, params) in enumerate(requests):
            core.add_request(f"r{i}", prompt, params, eos_token_ids=(2,))
        results.append(_run(core, abort_at))
        cores.append(core)
    sync, async_ = results
    assert async_ == sync
    return sync, cores[1]


def test_plain_decode_batch_is_bit_identical_and_overlaps(model_dir: Path) -> None:
    tokens, core = _both(model_dir, [(p, GREEDY) for p in _prompts(6)])
    assert all(len(t) == 12 for t in tokens.values())
    # NOTE: two steps were in flight at once: the overlap actually happened.
    assert core.make_stats().max_batches_in_flight == 2


def test_requests_ending_at_different_lengths(model_dir: Path) -> None:
    prompts = _prompts(6)
    reference, _ = _both(model_dir, [(p, GREEDY) for p in prompts])
    # a stop token id and an EOS id taken from the middle of the reference outputs
    stop_token = reference["r1"][4]
    eos_cut = reference["r3"][2]
    requests = [
        (prompts[0], SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)),
        (prompts[1], SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=[stop_token])),
        (prompts[2], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)),
        (prompts[3], SamplingParams(temperature=0.0, max_tokens=12)),
        (prompts[4], SamplingParams(temperature=0.0, max_tokens=3, min_tokens=2, ignore_eos=True)),
        (prompts[5], GREEDY),
    ]
    for async_scheduling in (False, True):
        core = _core(model_dir, async_scheduling)
        for i, (prompt, params) in enumerate(requests):
            eos = (eos_cut,) if i == 3 else (2,)
            core.add_request(f"r{i}", prompt, params, eos_token_ids=eos)
        tokens = _run(core)
        assert len(tokens["r0"]) == 1 and len(tokens["r2"]) == 5 and len(tokens["r4"]) == 3
        assert tokens["r1"][-1] == stop_token and len(tokens["r1"]) <= 5
        assert tokens["r3"][-1] == eos_cut and len(tokens["r3"]) <= 3
        assert tokens["r5"] == reference["r5"]
        for i in (1, 3):
            cut = len(tokens[f"r{i}"])
            assert tokens[f"r{i}"] == reference[f"r{i}"][:cut]


def test_max_model_len_caps_like_the_sync_engine(model_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    tokens, _ = _both(model_dir, [(p, params) for p in _prompts(3, 20)], max_model_len=40)
    assert sorted(len(t) for t in tokens.values()) == [18, 19, 20]


def test_abort_mid_stream(model_dir: Path) -> None:
    requests = [(p, SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True))
                for p in _prompts(4)]  # fmt: skip
    tokens, _ = _both(model_dir, requests, abort_at={"r1": 5, "r2": 1})
    assert len(tokens["r0"]) == 20 and len(tokens["r3"]) == 20
    assert len(tokens["r1"]) == 5 and len(tokens["r2"]) == 1


def test_abort_and_resubmit_under_the_same_id_while_in_flight(model_dir: Path) -> None:
    core = _core(model_dir, True)
    prompt_a, prompt_b = _prompts(2)
    core.add_request("x", prompt_a, GREEDY, eos_token_ids=())
    for _ in range(3):
        core.step()
    assert core.async_queue, "a step should be in flight"
    core.abort_requests(["x"])
    core.add_request("x", prompt_b, GREEDY, eos_token_ids=())
    tokens = _run(core)
    reference = _core(model_dir, False)
    reference.add_request("x", prompt_b, GREEDY, eos_token_ids=())
    # NOTE: the aborted request's in-flight tokens never reach the new one under its id.
    assert tokens["x"][-12:] == _run(reference)["x"]


def test_preemption_under_a_small_kv_cache(model_dir: Path) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    requests = [(p, params) for p in _prompts(6, 12)]
    _, core = _both(model_dir, requests, num_kv_blocks=12, block_size=16)
    assert core.make_stats().num_preemptions > 0


def test_seeded_sampling_and_n_with_preemption(model_dir: Path) -> None:
    requests = [
        (p, SamplingParams(temperature=1.0, seed=11 + i, max_tokens=30, ignore_eos=True))
        for i, p in enumerate(_prompts(6, 12))
    ]
    _, core = _both(model_dir, requests, num_kv_blocks=12, block_size=16)
    assert core.make_stats().num_preemptions > 0
    outputs = []
    for async_scheduling in (False, True):
        llm = LLM(str(model_dir), dtype="float32", max_model_len=256,
                  async_scheduling=async_scheduling)  # fmt: skip
        params = SamplingParams(n=3, temperature=0.8, top_p=0.9, seed=5, max_tokens=15)
        result = llm.generate([{"prompt_token_ids": p} for p in _prompts(3)], params)
        outputs.append([[c.token_ids for c in r.outputs] for r in result])
    assert outputs[0] == outputs[1]


def test_prefix_caching(model_dir: Path) -> None:
    shared = list(range(40, 88))
    requests = [(shared + [100 + i] * (i + 1), GREEDY) for i in range(5)]
    requests += [(shared + [100 + i] * (i + 1), GREEDY) for i in range(5)]
    _, core = _both(model_dir, requests, enable_prefix_caching=True)
    stats = core.make_stats()
    assert stats.prefix_cache_hits > 0


def test_chunked_prefill_mixed_with_decodes(model_dir: Path) -> None:
    core_kwargs = {"max_num_batched_tokens": 24, "long_prefill_token_threshold": 8}
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    results = []
    for async_scheduling in (False, True):
        core = _core(model_dir, async_scheduling, **core_kwargs)
        core.add_request("short", _prompts(1)[0], params, eos_token_ids=())
        tokens: dict[str, list[int]] = {}
        for step in range(400):
            if step == 3:
                # NOTE: long prompts arrive while `short` decodes: chunks next to decodes.
                for i, prompt in enumerate(_prompts(3, 60)):
                    core.add_request(f"long{i}", prompt, params, eos_token_ids=())
            if step > 3 and not core.has_unfinished_requests():
                break
            for output in core.step():
                tokens.setdefault(output.req_id, []).extend(output.new_token_ids)
            core.scheduler.check_invariants()
        results.append(tokens)
    assert results[0] == results[1]
    assert all(len(t) == 16 for t in results[0].values())


def _check_constrained_never_on_placeholders(scheduler: Any) -> None:
    schedule = scheduler.schedule

    def checked_schedule() -> Any:
        # NOTE: a constrained request is never scheduled on a placeholder: its bitmask needs
        # its accepted tokens (the core waited for the step in flight).
        for request in scheduler.running:
            if request.structured_output is not None:
                assert request.num_output_placeholders == 0, request
        return schedule()

    scheduler.schedule = checked_schedule


def test_structured_output_steps_run_synchronously(model_dir: Path) -> None:
    regex = r"[a-d]{3,8}x"
    constrained = StructuredOutputsParams.create(regex=regex)
    prompts = ["the quick brown fox", "jumps over a lazy dog", "seven wizards"]
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, structured_outputs=constrained),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=3, max_tokens=12, structured_outputs=constrained),
    ]
    texts = []
    for async_scheduling in (False, True):
        llm = LLM(str(model_dir), dtype="float32", max_model_len=256,
                  async_scheduling=async_scheduling)  # fmt: skip
        _check_constrained_never_on_placeholders(llm.engine_core.scheduler)
        texts.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
    assert texts[0] == texts[1]


def test_refused_by_name_where_it_cannot_run(model_dir: Path) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match="speculative_config"):
        EngineConfig.create(str(model_dir), async_scheduling=True, speculative_config=spec)
    kv = {"connector": "tcp", "role": "producer"}
    with pytest.raises(ValueError, match="kv_transfer_config"):
        EngineConfig.create(str(model_dir), async_scheduling=True, kv_transfer_config=kv)
    with pytest.raises(ValueError, match="distributed_executor_backend"):
        EngineConfig.create(str(model_dir), async_scheduling=True,
                            distributed_executor_backend="mp")  # fmt: skip
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        EngineConfig.create(str(model_dir), async_scheduling=True, tensor_parallel_size=2)
    # unset: off wherever it cannot run, whatever the level
    for level in (0, 1, 2, 3):
        config = EngineConfig.create(str(model_dir), optimization_level=level,
                                     speculative_config=spec)  # fmt: skip
        assert not config.scheduler.async_scheduling
    off = EngineConfig.create(str(model_dir), async_scheduling=False)
    assert not off.scheduler.async_scheduling


def test_spec_decoding_runs_synchronously_at_every_level(model_dir: Path) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    llm = LLM(str(model_dir), dtype="float32", max_model_len=256, speculative_config=spec)
    assert llm.engine_core.async_queue is None
    out = llm.generate([{"prompt_token_ids": _prompts(1)[0]}], GREEDY)
    assert len(out[0].outputs[0].token_ids) == 12


def test_the_flag_parses_both_ways() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args([])).async_scheduling is None
    on = EngineArgs.from_cli_args(parser.parse_args(["--async-scheduling"]))
    off = EngineArgs.from_cli_args(parser.parse_args(["--no-async-scheduling"]))
    assert on.async_scheduling is True and off.async_scheduling is False


def test_the_forward_runs_off_the_engine_core_thread(model_dir: Path) -> None:
    core = _core(model_dir, True)
    worker = core.executor.worker  # type: ignore[attr-defined]
    gate = threading.Event()
    threads: list[str] = []
    execute = worker.execute_model

    def gated(scheduler_output: Any) -> Any:
        threads.append(threading.current_thread().name)
        gate.wait(30)
        return execute(scheduler_output)

    worker.execute_model = gated
    core.add_request("a", _prompts(1)[0], GREEDY, eos_token_ids=())
    assert core.step() == []  # NOTE: submitted; returns while the step is blocked
    assert len(core.async_queue or []) == 1
    gate.set()
    tokens = _run(core)
    assert len(tokens["a"]) == 12
    assert threads and all(name.startswith("fleetserve-worker") for name in threads)
    assert threading.current_thread().name not in threads
    core.shutdown()


def test_a_failing_request_fails_alone_with_a_step_in_flight(model_dir: Path) -> None:
    prompts = _prompts(3)
    reference = _core(model_dir, False)
    for i, prompt in enumerate(prompts):
        reference.add_request(f"r{i}", prompt, GREEDY, eos_token_ids=())
    expected = _run(reference)
    core = _core(model_dir, True)
    vocab = core.config.model.vocab_size
    for i, prompt in enumerate(prompts):
        core.add_request(f"r{i}", prompt, GREEDY, eos_token_ids=())
    outputs: dict[str, list[EngineCoreOutput]] = {}
    for step in range(300):
        if step == 4:
            # NOTE: the good ones decode with a step in flight when the bad one arrives
            bad = SamplingParams(temperature=0.0, max_tokens=6, logit_bias={vocab + 5: 1.0})
            core.add_request("bad", [3, 4, 5, 6, 7], bad, eos_token_ids=())
        if step > 4 and not core.has_unfinished_requests():
            break
        for output in core.step():
            outputs.setdefault(output.req_id, []).append(output)
        core.scheduler.check_invariants()
    (failed,) = outputs["bad"]
    assert failed.finish_reason == "abort" and failed.error is not None
    assert "logit_bias" in failed.error
    assert core.make_stats().kv_cache_usage == 0.0 and not core.scheduler.isolation.active
    for i in range(3):
        assert [t for o in outputs[f"r{i}"] for t in o.new_token_ids] == expected[f"r{i}"]
