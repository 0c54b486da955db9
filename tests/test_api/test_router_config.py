"""RouterConfig: one definition of the router's flags, and the honest `fleetserve router`."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import fields

import pytest

from fleetserve.api.models import Disaggregation, RouterSpec
from fleetserve.api.router_config import RouterConfig
from fleetserve.cli import main
from fleetserve.router.cli import NOT_IMPLEMENTED

PD = {"prefill_selector": "a=b,r=prefill", "decode_selector": "a=b,r=decode"}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    RouterConfig.add_cli_args(parser)
    return parser


@pytest.mark.parametrize(
    "config",
    [
        RouterConfig(**PD),
        RouterConfig(
            mode="selective",
            min_uncached_tokens=0,
            prefix_aware=False,
            load_aware=False,
            namespace="ns",
            compatibility_hash="0123456789abcdef",
            engine_port=9000,
            host="127.0.0.5",
            port=1,
            **PD,
        ),
        RouterConfig(mode="never", unified_selector="a=b,r=unified", port=65535),
    ],
)
def test_args_round_trip(config: RouterConfig) -> None:
    args = config.to_args()
    assert RouterConfig.from_args(_parser().parse_args(args)) == config
    # Every set field is on the command line: nothing falls back to a parser default.
    flags = [a for a in args if a.startswith("--")]
    assert len(flags) == len([f for f in fields(config) if getattr(config, f.name) is not None])


def test_flags_come_from_the_fields() -> None:
    ns = _parser().parse_args(
        [
            "--disaggregation",
            "selective",
            "--min-uncached-tokens",
            "7",
            "--no-load-aware",
            "--unified-selector",
            "x=y",
        ]
    )
    config = RouterConfig.from_args(ns)
    assert (config.mode, config.min_uncached_tokens, config.load_aware, config.prefix_aware) == (
        "selective",
        7,
        False,
        True,
    )
    dests = {a.dest for a in _parser()._actions if a.dest != "help"}
    assert dests == {f.name for f in fields(RouterConfig)}


def test_field_names_match_the_api() -> None:
    names = {f.name for f in fields(RouterConfig)}
    assert set(Disaggregation.model_fields) <= names
    # Not routing settings: how many router pods, and where they run (the Deployment's).
    placement = {"replicas", "disaggregation", "node_selector", "tolerations"}
    assert set(RouterSpec.model_fields) - placement <= names
    defaults = RouterConfig(**PD)
    assert defaults.mode == Disaggregation().mode
    assert defaults.min_uncached_tokens == Disaggregation().min_uncached_tokens
    assert (defaults.prefix_aware, defaults.load_aware) == (
        RouterSpec().prefix_aware,
        RouterSpec().load_aware,
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({**PD, "mode": "sometimes"}, r"mode must be one of \['always', 'selective', 'never'\]"),
        ({**PD, "min_uncached_tokens": -1}, "min_uncached_tokens must be >= 0"),
        ({**PD, "port": 0}, r"port must be in 1\.\.65535"),
        ({**PD, "engine_port": 70000}, r"engine_port must be in 1\.\.65535"),
        ({"prefill_selector": "a"}, "prefill_selector and decode_selector, or unified_selector"),
        ({**PD, "unified_selector": "u"}, "unified_selector alone"),
        ({}, "unified_selector alone"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouterConfig(**kwargs)


def test_router_command_parses_then_refuses(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["router", *RouterConfig(**PD).to_args()]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == NOT_IMPLEMENTED + "\n"
    assert captured.err.startswith(
        "error: fleetserve router is not implemented in this build yet (issue 15); "
    )


def test_router_command_refuses_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router", "--prefill-selector", "a", "--decode-selector", "b", "--port", "0"]) == 2
    assert capsys.readouterr().err == "error: port must be in 1..65535, got 0\n"
    with pytest.raises(SystemExit) as exit_info:
        main(["router", "--disaggregation", "sometimes"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'sometimes'" in capsys.readouterr().err


def test_router_import_path_loads_no_torch_engine_or_operator() -> None:
    code = (
        "import sys, fleetserve.router.cli;"
        "loaded = {m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'kopf')"
        " or m.startswith(('fleetserve.engine', 'fleetserve.server', 'fleetserve.operator',"
        " 'fleetserve.kernels'))};"
        "assert not loaded, sorted(loaded)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
