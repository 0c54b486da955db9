"""Engine config validation: bad values name the field and the allowed values."""

from __future__ import annotations

import dataclasses
import inspect
import json
from pathlib import Path
from typing import Any

import pytest

from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.config import CacheConfig, EngineConfig, KVTransferConfig, SchedulerConfig
from fleetserve.envs import Env, read_env


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
        ({"custom_ops": "cuda"}, "custom_ops"),
        ({"eplb_policy": "random"}, "eplb_policy"),
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


# -- EngineArgs: the one definition, honest about what is not built -------------------------


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        (
            {
                "data_parallel_size": 2,
                "kv_transfer_config": {"connector": "tcp", "role": "producer"},
            },
            "data_parallel_size",
        ),
        ({"enable_expert_parallel": True}, "enable_expert_parallel"),
    ],
)
def test_unimplemented_options_are_refused_by_name(
    model_dir: Path, kwargs: dict[str, Any], name: str
) -> None:
    with pytest.raises(ValueError, match=rf"^{name}=.*does not implement yet \(issue 1\d\)"):
        EngineArgs(model=str(model_dir), device="cpu", **kwargs).create_engine_config()


def test_pipeline_layer_partition_must_fit_the_model(model_dir: Path) -> None:
    args = EngineArgs(
        model=str(model_dir), device="cpu", pipeline_parallel_size=2, pipeline_layer_partition="1"
    )
    with pytest.raises(ValueError, match="pipeline_layer_partition must give 2 stage"):
        args.create_engine_config()


def test_eplb_settings_need_eplb(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="eplb_window_size is an EPLB setting"):
        EngineArgs(model=str(model_dir), device="cpu", eplb_window_size=5).create_engine_config()


def test_eplb_config_fields_are_the_api_eplb_block() -> None:
    """The engine's `EPLBConfig` and the CRD's `eplb` block (`api.models.EPLB`): the same field
    names, defaults, policies and bounds, so a role's block maps onto the engine's config."""
    from typing import get_args

    from pydantic import ValidationError

    from fleetserve.api.models import EPLB
    from fleetserve.engine.config import _EPLB_POLICIES, EPLBConfig

    names = [f.name for f in dataclasses.fields(EPLBConfig)]
    assert names == list(EPLB.model_fields)
    assert dataclasses.asdict(EPLBConfig()) == EPLB().model_dump()
    assert set(get_args(EPLB.model_fields["policy"].annotation)) == set(_EPLB_POLICIES)
    with pytest.raises(ValueError, match="policy must be one of"):
        EPLBConfig(policy="random")
    for name, lowest in [("redundant_experts", 0), ("window_size", 1), ("step_interval", 1)]:
        edge: dict[str, Any] = {name: lowest}
        below: dict[str, Any] = {name: lowest - 1}
        EPLB.model_validate(edge)
        EPLBConfig(**edge)
        with pytest.raises(ValidationError):
            EPLB.model_validate(below)
        with pytest.raises(ValueError, match=f"{name} must be >= {lowest}"):
            EPLBConfig(**below)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({"connector": "tcp", "role": "producer", "lease": 3}, r"keys must be among .*'lease'"),
        ({"role": "producer"}, r"kv_transfer_config\.connector is required"),
        ({"connector": "nixl", "role": "producer"}, r"kv_transfer_config\.connector must be"),
        ({"connector": "tcp", "role": "boss"}, r"kv_transfer_config\.role must be one of"),
        ({"connector": "tcp", "role": "both", "lease_seconds": 0}, "lease_seconds"),
    ],
)
def test_kv_transfer_config_is_parsed_strictly(
    model_dir: Path, value: dict[str, Any], match: str
) -> None:
    with pytest.raises(ValueError, match=match):
        EngineArgs(model=str(model_dir), kv_transfer_config=value).create_engine_config()
    assert KVTransferConfig.from_dict({"connector": "mooncake", "role": "both"}).lease_seconds == 30
    config = EngineArgs(
        model=str(model_dir), device="cpu",
        kv_transfer_config={"connector": "tcp", "role": "producer", "transfer_mode": "push"},
    ).create_engine_config()  # fmt: skip
    assert config.kv_transfer == KVTransferConfig("tcp", "producer", transfer_mode="push")


def test_unknown_keyword_lists_the_known_ones(model_dir: Path) -> None:
    with pytest.raises(
        ValueError, match=r"unknown engine argument\(s\) \['max_seqs'\].*max_num_seqs"
    ):
        EngineConfig.create(str(model_dir), max_seqs=3)


def test_the_pod_environment_must_match_the_parallel_sizes(model_dir: Path) -> None:
    args = EngineArgs(model=str(model_dir), device="cpu")
    assert args.create_engine_config(Env(world_size=1, rank=0)).parallel.world_size == 1
    with pytest.raises(ValueError, match=r"FLEETSERVE_WORLD_SIZE=2 does not match"):
        args.create_engine_config(Env(world_size=2, rank=0))
    with pytest.raises(ValueError, match=r"FLEETSERVE_RANK=1 must be < the world size 1"):
        args.create_engine_config(Env(world_size=1, rank=1))
    with pytest.raises(ValueError, match=r"FLEETSERVE_WORLD_SIZE must be int, got 'two'"):
        read_env({"FLEETSERVE_WORLD_SIZE": "two"})


def test_llm_signature_lists_every_engine_argument() -> None:
    from fleetserve import LLM

    params = inspect.signature(LLM).parameters
    assert list(params) == EngineArgs.names()
    assert params["max_num_seqs"].default == 256
