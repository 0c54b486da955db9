"""`fleetserve serve` flags → ServerConfig (no engine is started)."""

from __future__ import annotations

import argparse

import pytest

from fleetserve.server.cli import build_server_config, register


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def test_engine_and_server_flags_reach_the_config() -> None:
    from fleetserve.engine.models.bundled import bundled_model_path

    model = str(bundled_model_path())
    args = _parse(
        model, "--max-model-len", "256", "--block-size", "8", "--max-num-seqs", "3",
        "--no-enable-prefix-caching", "--scheduling-policy", "priority",
        "--long-prefill-token-threshold", "32", "--full-sequence-must-fit", "--served-model-name", "smol", "--api-key", "k", "--max-waiting-requests", "5",
        "--dtype", "float32", "--device", "cpu",
    )  # fmt: skip
    config = build_server_config(args)
    assert config.engine.model.max_model_len == 256
    assert config.engine.cache.block_size == 8
    assert not config.engine.cache.enable_prefix_caching
    assert config.engine.scheduler.max_num_seqs == 3
    assert config.engine.scheduler.policy == "priority"
    assert config.engine.scheduler.long_prefill_token_threshold == 32
    assert config.engine.scheduler.full_sequence_must_fit
    assert config.engine.kv_transfer is None
    assert (config.served_model_name, config.api_key, config.max_waiting_requests) == (
        "smol", "k", 5,
    )  # fmt: skip


def test_bad_flags_are_refused() -> None:
    with pytest.raises(SystemExit):
        _parse("m", "--kv-transfer-config", "[1, 2]")
    with pytest.raises(SystemExit):
        _parse("m", "--dtype", "int4")
    args = _parse("/nonexistent/model")
    with pytest.raises(ValueError, match="model must be a Hugging Face model folder"):
        build_server_config(args)


def test_unimplemented_flags_are_refused_by_name() -> None:
    from fleetserve.engine.models.bundled import bundled_model_path

    model = str(bundled_model_path())
    for flags, name in (
        (["--enable-expert-parallel"], "enable_expert_parallel"),
        (["--data-parallel-size", "2", "--pipeline-parallel-size", "2"], "data_parallel_size"),
    ):
        with pytest.raises(ValueError, match=rf"^{name}=.*not implement"):
            build_server_config(_parse(model, *flags))
