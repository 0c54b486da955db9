"""The roofline arithmetic the offline and decode benches print, and the weight count behind it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fleetserve.bench.decode import SHAPES, weight_count, write_shape_folder
from fleetserve.bench.offline import multiplied_weights
from fleetserve.bench.roofline import Roofline
from fleetserve.engine.config import EngineConfig
from tests.engine.tiny_models import load_engine_model


def test_step_bound_is_the_slower_of_reading_and_multiplying() -> None:
    roofline = Roofline(bandwidth_gb_s=10.0, gemm_gflop_s=100.0)
    # 1 GB of weights, 250 M weights: reading takes 0.1 s; 1 token 0.005 s, 32 tokens 0.16 s.
    assert roofline.step_seconds(10**9, 250 * 10**6, 1) == pytest.approx(0.1)
    assert roofline.step_seconds(10**9, 250 * 10**6, 32) == pytest.approx(0.16)


@pytest.mark.parametrize("tied", [False, True])
def test_offline_weight_formula_equals_the_loaded_models_count(tmp_path: Path, tied: bool) -> None:
    folder = write_shape_folder("tiny", tmp_path)
    config = {**SHAPES["tiny"], "tie_word_embeddings": tied}
    (folder / "config.json").write_text(json.dumps(config))
    model = load_engine_model(
        EngineConfig.create(str(folder), dtype="float32", load_format="dummy")
    )
    assert multiplied_weights(config) == weight_count(model)
