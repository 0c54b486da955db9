"""The CRD's LoRA adapters rendered as engine flags every role's pods parse."""

from __future__ import annotations

import argparse
from typing import Any

import pytest
from pydantic import ValidationError

from fleetserve.api.crd import crd_yaml
from fleetserve.api.models import InferenceDeploymentSpec
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.operator.render import adapter_path, engine_args
from fleetserve.server.cli import register


def spec(uri: str = "pvc://models/llama", **lora: Any) -> InferenceDeploymentSpec:
    body = {
        "model": {"name": "llama", "source": {"uri": uri}, "lora": lora},
        "roles": {"prefill": {}, "decode": {}},
        "kvTransfer": {"connector": "tcp"},
    }
    return InferenceDeploymentSpec.model_validate(body)


def parse(argv: list[str]) -> EngineArgs:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return EngineArgs.from_cli_args(parser.parse_args(argv))


def test_every_role_renders_the_adapters_and_the_engine_parses_them() -> None:
    adapters = [
        {"name": "sql", "uri": "pvc://models/adapters/sql"},
        {"name": "chat", "uri": "/opt/chat"},
    ]
    deployment = spec(adapters=adapters, maxLoras=2, maxCpuLoras=4, maxLoraRank=32)
    for role_name, role in deployment.roles.items():
        argv = engine_args(deployment, role_name, role)
        args = parse(argv)
        assert args.enable_lora, role_name
        assert (args.max_loras, args.max_cpu_loras, args.max_lora_rank) == (2, 4, 32)
        assert args.lora_modules == ["sql=/model/adapters/sql", "chat=/opt/chat"]


def test_no_lora_block_renders_no_lora_flag() -> None:
    body = {
        "model": {"name": "m", "source": {"uri": "/m"}},
        "roles": {"unified": {}},
        "kvTransfer": {"connector": "none"},
    }
    deployment = InferenceDeploymentSpec.model_validate(body)
    argv = engine_args(deployment, "unified", deployment.roles.unified)  # type: ignore[arg-type]
    assert not [a for a in argv if "lora" in a]


@pytest.mark.parametrize(
    ("model", "adapter", "path"),
    [
        ("pvc://models/llama", "pvc://models/lora/a", "/model/lora/a"),
        ("hostpath:///data/llama", "hostpath:///data/llama/lora/a", "/model/lora/a"),
        ("/m", "/adapters/a", "/adapters/a"),
    ],
)
def test_an_adapter_on_the_models_volume_is_read_from_its_mount(
    model: str, adapter: str, path: str
) -> None:
    assert adapter_path(model, adapter) == path


@pytest.mark.parametrize(
    ("model", "adapter"),
    [
        ("pvc://models/llama", "pvc://other/lora/a"),
        ("hostpath:///data/llama", "hostpath:///elsewhere/a"),
        ("pvc://models/llama", "s3://bucket/a"),
        ("/m", "pvc://models/a"),
    ],
)
def test_an_adapter_the_pods_cannot_reach_is_refused_naming_it(model: str, adapter: str) -> None:
    with pytest.raises(
        ValueError, match=r"model.lora.adapters uri .* must be on the model.s volume"
    ):
        adapter_path(model, adapter)


@pytest.mark.parametrize(
    ("lora", "message"),
    [
        (
            {"adapters": [{"name": "a", "uri": "/a"}, {"name": "a", "uri": "/b"}]},
            "names must be unique",
        ),
        ({"maxLoras": 4, "maxCpuLoras": 2}, "maxCpuLoras must be >= maxLoras"),
        ({"maxLoraRank": 12}, "max_lora_rank|maxLoraRank"),
        ({"adapters": [{"name": "bad name", "uri": "/a"}]}, "pattern"),
    ],
)
def test_bad_lora_blocks_fail_validation_with_a_message(lora: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        spec(**lora)


def test_the_crd_schema_carries_the_lora_block() -> None:
    text = crd_yaml()
    for key in ("lora:", "adapters:", "maxLoras:", "maxCpuLoras:", "maxLoraRank:"):
        assert key in text


def test_lora_with_tensor_parallel_roles_fails_validation() -> None:
    body = {
        "model": {"name": "m", "source": {"uri": "/m"}, "lora": {}},
        "roles": {"prefill": {"parallelism": {"tensor": 2}, "gpusPerPod": 2}, "decode": {}},
    }
    with pytest.raises(
        ValidationError, match=r"roles.prefill: model.lora needs tensor and pipeline"
    ):
        InferenceDeploymentSpec.model_validate(body)
