"""Acceptance 1 (pipeline part): greedy outputs of PP=2 and TP=2 × PP=2 equal TP=1's exactly in
float32 on tiny Llama and Qwen2, with chunked prefill and preemption active, while the engine
core keeps one batch in flight per stage (the batch queue), and with one batch at a time."""

from __future__ import annotations

from functools import partial
from pathlib import Path

import pytest

from fleetserve import LLM, SamplingParams
from fleetserve.engine import llm as llm_module
from fleetserve.engine.config import EngineConfig
from fleetserve.engine.core.engine_core import EngineCore
from fleetserve.engine.distributed.stages import parse_layer_partition, stage_layer_range
from tests.engine.distributed.test_tp_fidelity import LENGTHS, MAX_TOKENS, SETTINGS, _generate
from tests.engine.tiny_models import make_prompts, make_tiny_model


def test_layers_split_evenly_or_as_configured() -> None:
    assert [stage_layer_range(7, s, 3) for s in range(3)] == [(0, 3), (3, 5), (5, 7)]
    assert [stage_layer_range(4, s, 2, (1, 3)) for s in range(2)] == [(0, 1), (1, 4)]
    assert parse_layer_partition("1,3") == (1, 3) and parse_layer_partition(None) is None
    with pytest.raises(ValueError, match="pipeline_layer_partition must give 2 stage"):
        stage_layer_range(4, 0, 2, (2, 3))
    with pytest.raises(ValueError, match="pipeline_parallel_size \\(3\\) must be <="):
        stage_layer_range(2, 0, 3)
    with pytest.raises(ValueError, match="pipeline_layer_partition must be positive"):
        parse_layer_partition("2,x")


@pytest.fixture(scope="module")
def tiny_tied_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Three layers (an uneven split) and a tied LM head (the last stage has no embedding).
    return make_tiny_model(
        tmp_path_factory.mktemp("tied"), "llama", num_hidden_layers=3, tie_word_embeddings=True
    )


@pytest.mark.timeout(600)
@pytest.mark.parametrize(
    ("arch", "parallel"),
    [
        ("llama", {"pipeline_parallel_size": 2}),
        ("qwen2", {"pipeline_parallel_size": 2, "tensor_parallel_size": 2}),
        ("tied", {"pipeline_parallel_size": 2, "pipeline_layer_partition": "1,2"}),
    ],
)
def test_pipeline_parallel_equals_one_rank(
    arch: str,
    parallel: dict[str, object],
    tiny_llama_dir: Path,
    tiny_qwen2_dir: Path,
    tiny_tied_llama_dir: Path,
) -> None:
    model_dir = {"llama": tiny_llama_dir, "qwen2": tiny_qwen2_dir, "tied": tiny_tied_llama_dir}[
        arch
    ]
    prompts = make_prompts(512, LENGTHS, seed=4)
    single = LLM(str(model_dir), **SETTINGS)
    expected = _generate(single, prompts)
    single.engine_core.shutdown()
    llm = LLM(str(model_dir), **parallel, **SETTINGS)  # type: ignore[arg-type]
    try:
        assert _generate(llm, prompts) == expected
        stats = llm.engine_core.make_stats()
        assert stats.num_preemptions > 0
        assert stats.max_batches_in_flight == 2, "the stages never had a batch each"
        assert stats.num_batches_in_flight == 0
    finally:
        llm.engine_core.shutdown()


@pytest.mark.timeout(600)
def test_one_batch_at_a_time_is_the_synchronous_pipeline(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`max_concurrent_batches=1` (the baseline of `fleetserve bench parallel`'s PP table) runs
    the synchronous step over the same stages, to the same tokens."""
    prompts = make_prompts(512, LENGTHS, seed=4)
    single = LLM(str(tiny_llama_dir), **SETTINGS)
    expected = _generate(single, prompts)
    single.engine_core.shutdown()
    config = EngineConfig.create(str(tiny_llama_dir), pipeline_parallel_size=2, **SETTINGS)
    with pytest.raises(ValueError, match=r"max_concurrent_batches must be in \[1, 2\]"):
        EngineCore(config, max_concurrent_batches=3)
    monkeypatch.setattr(llm_module, "EngineCore", partial(EngineCore, max_concurrent_batches=1))
    llm = LLM(str(tiny_llama_dir), pipeline_parallel_size=2, **SETTINGS)  # type: ignore[arg-type]
    try:
        assert llm.engine_core.batch_queue is None
        assert _generate(llm, prompts) == expected
        assert llm.engine_core.make_stats().max_batches_in_flight == 0
    finally:
        llm.engine_core.shutdown()


@pytest.mark.timeout(600)
def test_abort_and_resubmit_of_a_request_in_flight(tiny_llama_dir: Path) -> None:
    """A request aborted while its batch is in the stages, and resubmitted at once under the
    same id with another prompt: the stages drop the old one behind the batches in flight, the
    new one and the others get TP=1's tokens."""
    prompts = make_prompts(512, [12, 20, 9, 15, 26], seed=6)
    replacement = make_prompts(512, [11], seed=7)[0]
    single = LLM(str(tiny_llama_dir), **SETTINGS)
    expected = _generate(single, [replacement, *prompts[1:]])
    eos = single.eos_token_ids
    single.engine_core.shutdown()
    config = EngineConfig.create(str(tiny_llama_dir), pipeline_parallel_size=2, **SETTINGS)
    core = EngineCore(config)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
        for i, prompt in enumerate(prompts):
            core.add_request(f"r{i}", prompt, params, eos_token_ids=eos)
        tokens: dict[str, list[int]] = {}
        assert core.scheduler.in_flight is not None
        first = core.scheduler.requests["r0"]
        for _ in range(50):
            was_in_flight = first in core.scheduler.in_flight
            for out in core.step():
                tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
            # NOTE: r0 decoding in the newest of two batches, so the stages still hold its state
            # for two batches after the abort (the scheduler-level test covers its output
            # arriving while the new r0 runs: test_pp_batch_queue).
            newest = not was_in_flight and first in core.scheduler.in_flight
            if newest and len(core.batch_queue) == 2 and tokens.get("r0"):
                break
        assert first in core.scheduler.in_flight and tokens.get("r0"), "r0 never decoded in flight"
        core.abort_requests(["r0"])
        core.add_request("r0", replacement, params, eos_token_ids=eos)
        tokens["r0"] = []
        while core.has_unfinished_requests():
            for out in core.step():
                tokens.setdefault(out.req_id, []).extend(out.new_token_ids)
        assert [tokens[f"r{i}"] for i in range(len(prompts))] == expected
    finally:
        core.shutdown()
