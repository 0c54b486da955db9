"""`speculative_config` is validated into a frozen `SpeculativeConfig` with errors naming the
field and its allowed values; `--speculative-config` takes the same JSON."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

import pytest

from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.config import EngineConfig, SpeculativeConfig
from tests.engine.tiny_models import make_tiny_model


def test_ngram_defaults_and_frozen() -> None:
    spec = SpeculativeConfig.from_dict({"method": "ngram", "num_speculative_tokens": 3})
    assert (spec.prompt_lookup_max, spec.prompt_lookup_min, spec.num_lookahead_tokens) == (4, 1, 0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.num_speculative_tokens = 5  # type: ignore[misc]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.method must be one of"),
        ({"num_speculative_tokens": 2}, "speculative_config.method must be one of"),
        ({"method": "ngram"}, "num_speculative_tokens is required"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
        ({"method": "ngram", "num_speculative_tokens": 99}, r"in \[1, 16\]"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 3,
             "prompt_lookup_max": 2},
            "prompt_lookup_max must be an integer >= prompt_lookup_min",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "keys for method 'ngram'"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
        (
            {"method": "draft_model", "num_speculative_tokens": 2, "model": "x",
             "prompt_lookup_max": 3},
            "keys for method 'draft_model'",
        ),
    ],
)  # fmt: skip
def test_bad_configs_name_the_field(data: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict(data)


def test_engine_config_carries_it(tiny_llama_dir: Path) -> None:
    spec = {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 3}
    config = EngineConfig.create(str(tiny_llama_dir), speculative_config=spec)
    assert config.speculative == SpeculativeConfig("ngram", 2, prompt_lookup_max=3)
    assert EngineConfig.create(str(tiny_llama_dir)).speculative is None


def test_the_cli_flag_parses_json(tiny_llama_dir: Path) -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    namespace = parser.parse_args(
        [str(tiny_llama_dir), "--speculative-config",
         '{"method": "ngram", "num_speculative_tokens": 4}']
    )  # fmt: skip
    config = EngineArgs.from_cli_args(namespace).create_engine_config()
    assert config.speculative is not None and config.speculative.num_speculative_tokens == 4


def test_a_draft_model_must_share_the_vocabulary(tmp_path: Path, tiny_llama_dir: Path) -> None:
    other = make_tiny_model(tmp_path, "llama", vocab_size=384)
    spec = {"method": "draft_model", "model": str(other), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"speculative_config.model must have the target's"):
        EngineConfig.create(str(tiny_llama_dir), speculative_config=spec)


def test_a_draft_model_must_reach_max_model_len(tmp_path: Path, tiny_llama_dir: Path) -> None:
    short = make_tiny_model(tmp_path, "llama", max_position_embeddings=64)
    spec = {"method": "draft_model", "model": str(short), "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"reach max_model_len \(256\)"):
        EngineConfig.create(str(tiny_llama_dir), speculative_config=spec)


def test_a_draft_model_on_a_pd_engine_is_refused(tiny_llama_dir: Path) -> None:
    spec = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 2}
    kv = {"connector": "tcp", "role": "consumer"}
    with pytest.raises(ValueError, match="use method 'ngram' on P/D engines"):
        EngineConfig.create(str(tiny_llama_dir), speculative_config=spec, kv_transfer_config=kv)


@pytest.mark.parametrize("name", ["tensor_parallel_size", "pipeline_parallel_size"])
def test_speculation_with_several_ranks_is_refused_naming_the_size(name: str) -> None:
    args = EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                      **{name: 2})  # fmt: skip
    with pytest.raises(ValueError, match=f"{name}=2 with speculative_config"):
        args.create_engine_config()
