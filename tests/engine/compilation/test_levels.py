"""Optimization levels: defaults only, explicit flags win, -O0 compiles and captures nothing."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from fleetserve import LLM, SamplingParams
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.compilation.levels import (
    DEFAULT_LEVEL,
    level_defaults,
    lower_level_hint,
)
from fleetserve.engine.config import DeviceConfig
from fleetserve.engine.layers.attention.cpu_backend import CpuPagedAttentionBackend
from fleetserve.engine.layers.attention.torch_backend import TorchAttentionBackend
from fleetserve.engine.worker.executor import UniProcExecutor
from fleetserve.kernels.cpu.build import load_cpu_kernels


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir: Path) -> str:
    """The session's tiny llama (tests/engine/conftest.py), shared with the other engine tests."""
    return str(tiny_llama_dir)


def _device(tiny: str, **kwargs: Any) -> DeviceConfig:
    return EngineArgs(model=tiny, device="cpu", **kwargs).create_engine_config().device


def test_o0_compiles_and_captures_nothing(tiny: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """At -O0 the C++ kernel is never built or loaded, no graph is captured, and it serves."""

    def no_build() -> None:
        raise AssertionError("-O0 must not build or load the CPU kernels")

    monkeypatch.setattr("fleetserve.engine.layers.attention.cpu_backend.load_cpu_kernels", no_build)
    llm = LLM(tiny, dtype="float32", optimization_level=0, num_kv_blocks=32, max_model_len=64)
    assert llm.config.device.enforce_eager
    assert llm.config.device.attention_backend == "torch"
    executor = llm.engine_core.executor
    assert isinstance(executor, UniProcExecutor)
    worker = executor.worker
    assert worker.cuda_graph_off_reason() == "enforce_eager is set"
    assert worker.model_runner.decode_graphs is None
    model = worker.model_runner.model
    assert model is not None
    assert model.attn_backend is TorchAttentionBackend
    out = llm.generate(
        [{"prompt_token_ids": [5, 6, 7]}], SamplingParams(temperature=0, max_tokens=3)
    )
    assert len(out[0].outputs[0].token_ids) == 3


def test_default_level_is_o2_and_only_o3_compiles(tiny: str) -> None:
    assert EngineArgs().optimization_level == DEFAULT_LEVEL == 2
    assert level_defaults(2) == level_defaults(1)
    assert level_defaults(0).enforce_eager and not level_defaults(0).fused_cpu_attention
    assert [level_defaults(n).compile_min_tokens for n in range(4)] == [0, 0, 0, 256]
    device = _device(tiny)
    assert device.optimization_level == 2
    assert not device.enforce_eager
    assert device.attention_backend == "auto"
    assert device.compile_min_tokens == 0
    assert _device(tiny, optimization_level=3).compile_min_tokens == 256


def test_an_explicit_flag_beats_the_level(tiny: str) -> None:
    assert _device(tiny, optimization_level=2, enforce_eager=True).enforce_eager
    assert not _device(tiny, optimization_level=0, enforce_eager=False).enforce_eager
    explicit = _device(tiny, optimization_level=0, attention_backend="cpu_paged")
    assert explicit.attention_backend == "cpu_paged"
    assert explicit.enforce_eager  # the knob left unset still follows -O0
    assert _device(tiny, optimization_level=3, compile_min_tokens=0).compile_min_tokens == 0
    assert _device(tiny, optimization_level=0, compile_min_tokens=64).compile_min_tokens == 64


def test_compiling_on_cuda_is_refused() -> None:
    with pytest.raises(ValueError, match="compile_min_tokens must be 0 on cuda"):
        DeviceConfig(device="cuda", compile_min_tokens=256)
    with pytest.raises(ValueError, match="compile_min_tokens must be >= 0"):
        DeviceConfig(device="cpu", compile_min_tokens=-1)


@pytest.mark.skipif(not load_cpu_kernels().available, reason=str(load_cpu_kernels().error))
def test_o2_serves_with_the_fused_attention_on_the_cpu(tiny: str) -> None:
    llm = LLM(tiny, dtype="float32", num_kv_blocks=32, max_model_len=64)
    executor = llm.engine_core.executor
    assert isinstance(executor, UniProcExecutor)
    model = executor.worker.model_runner.model
    assert model is not None
    assert model.attn_backend is CpuPagedAttentionBackend


def test_cli_takes_the_short_and_long_forms() -> None:
    parser = argparse.ArgumentParser()
    EngineArgs.add_cli_args(parser)
    assert EngineArgs.from_cli_args(parser.parse_args(["-O0"])).optimization_level == 0
    assert EngineArgs.from_cli_args(parser.parse_args(["-O", "3"])).optimization_level == 3
    args = EngineArgs.from_cli_args(parser.parse_args(["--optimization-level", "1"]))
    assert args.optimization_level == 1
    assert EngineArgs.from_cli_args(parser.parse_args([])).enforce_eager is None
    assert EngineArgs.from_cli_args(parser.parse_args(["--enforce-eager"])).enforce_eager


def test_a_bad_level_is_refused_naming_the_field(tiny: str) -> None:
    with pytest.raises(
        ValueError, match=r"optimization_level must be one of \[0, 1, 2, 3\], got 5"
    ):
        _device(tiny, optimization_level=5)


def test_a_failure_names_the_level_and_suggests_a_lower_one() -> None:
    hint = lower_level_hint(2, "CUDA graph capture")
    assert "failed at optimization level -O2" in hint and "retry with -O1" in hint
    assert "-O0" in lower_level_hint(1, "CUDA graph capture")
