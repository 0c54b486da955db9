"""Acceptance 1 (pipeline part): greedy outputs of PP=2 and TP=2 × PP=2 equal TP=1's exactly in
float32 on tiny Llama and Qwen2, with chunked prefill and preemption active. The pipeline is
synchronous: one batch in flight across the stages."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetserve import LLM
from fleetserve.engine.distributed.stages import parse_layer_partition, stage_layer_range
from tests.engine.distributed.test_tp_fidelity import LENGTHS, SETTINGS, _generate
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
        assert llm.engine_core.make_stats().num_preemptions > 0
    finally:
        llm.engine_core.shutdown()
