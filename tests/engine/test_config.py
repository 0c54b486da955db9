"""Engine config validation: bad values name the field and the allowed values."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fleetserve.engine.config import CacheConfig, EngineConfig, SchedulerConfig


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "vocab_size": 100,
                "max_position_embeddings": 512,
            }
        )
    )
    return tmp_path


def test_create_resolves_auto_values(model_dir: Path) -> None:
    config = EngineConfig.create(str(model_dir), device="cpu")
    assert config.model.dtype == "float32"
    assert config.model.max_model_len == 512
    assert config.scheduler.max_model_len == 512
    assert config.device.device == "cpu"


def test_configs_are_frozen(model_dir: Path) -> None:
    config = EngineConfig.create(str(model_dir), device="cpu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache.block_size = 32  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"dtype": "int4"}, "dtype"),
        ({"device": "tpu"}, "device"),
        ({"max_model_len": 4096}, "max_model_len"),
        ({"block_size": 12}, "block_size"),
        ({"num_kv_blocks": 1}, "num_kv_blocks"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"scheduling_policy": "lifo"}, "policy"),
        ({"attention_backend": "magic"}, "attention_backend"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
    ],
)
def test_bad_values_name_the_field(model_dir: Path, kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ValueError, match=field):
        EngineConfig.create(str(model_dir), **{"device": "cpu", **kwargs})  # type: ignore[arg-type]


def test_not_a_model_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"config\.json"):
        EngineConfig.create(str(tmp_path))


def test_chunked_prefill_off_needs_room_for_a_whole_prompt() -> None:
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=16, max_model_len=64, enable_chunked_prefill=False)
    assert CacheConfig().block_size == 16
