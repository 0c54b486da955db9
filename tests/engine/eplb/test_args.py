"""The engine arguments' EPLB rules: refused by name, before any model is built."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.eplb.args import check_eplb_args

MOE = {
    "architectures": ["MixtralForCausalLM"],
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "intermediate_size": 64,
}


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 100}
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def _check(**overrides: Any) -> None:
    kwargs: dict[str, Any] = {
        "enable_eplb": True,
        "enable_expert_parallel": True,
        "num_redundant_experts": 2,
        "tensor_parallel_size": 2,
        "data_parallel_size": 1,
        "hf_config": MOE,
    }
    check_eplb_args(**{**kwargs, **overrides})


def test_valid_settings_pass() -> None:
    _check()
    _check(num_redundant_experts=0, hf_config={**MOE, "num_local_experts": 4})
    _check(enable_eplb=False, enable_expert_parallel=False, hf_config={})


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"enable_expert_parallel": False}, r"enable_eplb needs enable_expert_parallel=True"),
        ({"hf_config": {"hidden_size": 64}}, r"enable_eplb needs a MoE model"),
        (
            {"num_redundant_experts": 3},
            r"num_redundant_experts \(3\) must be a multiple of the EP group "
            r"\(tensor_parallel_size × data_parallel_size = 2\)",
        ),
        (
            {"hf_config": {**MOE, "num_local_experts": 7}, "num_redundant_experts": 2},
            r"7 experts \+ num_redundant_experts \(2\) must split evenly",
        ),
    ],
)
def test_bad_settings_are_refused_by_name(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        _check(**overrides)


def test_engine_args_apply_the_rules(model_dir: Path) -> None:
    # A dense model without expert parallel: the first rule that fails names the missing flag.
    with pytest.raises(ValueError, match="enable_eplb needs enable_expert_parallel=True"):
        EngineArgs(model=str(model_dir), device="cpu", enable_eplb=True).create_engine_config()
    with pytest.raises(ValueError, match="eplb_use_async is an EPLB setting"):
        EngineArgs(model=str(model_dir), device="cpu", eplb_use_async=True).create_engine_config()
