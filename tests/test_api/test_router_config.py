"""RouterConfig: one definition of the router's flags (static and Kubernetes discovery), and
`fleetserve router` refusing bad flags before it starts."""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import fields

import pytest

from fleetserve.api.models import Disaggregation, RouterSpec
from fleetserve.api.router_config import RouterConfig
from fleetserve.cli import main

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
        RouterConfig(
            discovery="static",
            prefill=("http://127.0.0.1:8101",),
            decode=("http://127.0.0.1:8102", "https://[::1]:8103"),
            engine=("http://e:1",),
            mode="selective",
            engine_api_key="k",
            queue_timeout_s=0.5,
            breaker_failures=7,
        ),
    ],
)
def test_args_round_trip(config: RouterConfig) -> None:
    args = config.to_args()
    assert RouterConfig.from_args(_parser().parse_args(args)) == config
    # Every set field is on the command line (a URL list once per URL): nothing falls back to a
    # parser default.
    flags = [a for a in args if a.startswith("--")]
    expected = 0
    for f in fields(config):
        value = getattr(config, f.name)
        expected += len(value) if isinstance(value, tuple) else value is not None
    assert len(flags) == expected


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
    # Not routing settings: how many router pods, where they run, what they request, and how
    # long a stopping one may finish its streams (the Deployment's; rendered as
    # shutdown_grace_s, test_builders).
    placement = {"replicas", "disaggregation", "node_selector", "tolerations",
                 "drain_timeout_seconds", "cpu", "memory"}  # fmt: skip
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
        ({**PD, "join_wait_s": -1.0}, "join_wait_s must be >= 0 seconds"),
        ({"prefill_selector": "a"}, "prefill_selector and decode_selector, or unified_selector"),
        ({**PD, "unified_selector": "u"}, "unified_selector alone"),
        ({}, "unified_selector alone"),
    ],
)
def test_bad_values_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouterConfig(**kwargs)


def test_the_static_cli_contract() -> None:
    line = (
        "--discovery static --prefill http://127.0.0.1:8101 --decode http://127.0.0.1:8102"
        " --engine http://127.0.0.1:8103 --host 127.0.0.1 --port 8000 --disaggregation"
        " selective --min-uncached-tokens 32 --no-prefix-aware --no-load-aware"
    )
    args = line.split(" ")
    config = RouterConfig.from_args(_parser().parse_args(args))
    assert (config.prefill, config.decode, config.engine) == (
        ("http://127.0.0.1:8101",), ("http://127.0.0.1:8102",), ("http://127.0.0.1:8103",),
    )  # fmt: skip
    assert (config.host, config.port, config.mode, config.min_uncached_tokens) == (
        "127.0.0.1", 8000, "selective", 32,
    )  # fmt: skip
    assert not config.prefix_aware and not config.load_aware
    line = (
        "--discovery kubernetes --namespace ns --prefill-selector a=p --decode-selector a=d"
        " --compatibility-hash h --engine-port 8000 --port 8080"
    )
    k8s = line.split(" ")
    config = RouterConfig.from_args(_parser().parse_args(k8s))
    assert (config.namespace, config.prefill_selector, config.engine_port) == ("ns", "a=p", 8000)


S = {"discovery": "static"}


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({**S}, "needs at least one decode or engine URL"),
        ({**S, "prefill": ("http://p:1",)}, "prefill URLs need at least one decode URL"),
        ({**S, "decode": ("http://d:1",)}, "need at least one prefill URL"),
        ({**S, "decode": ("http://d:1", "http://d:1"), "mode": "never"}, "listed twice"),
        ({**S, "engine": ("d:1",)}, "engine URL must look like http://HOST:PORT"),
        ({**S, "engine": ("http://d",)}, "engine URL must look like"),
        ({**S, "decode": ("http://d:1/v1",), "mode": "never"}, "decode URL must look like"),
        ({**S, "engine": ("http://e:1",), **PD}, "prefill_selector is for discovery kubernetes"),
        ({**PD, "decode": ("http://d:1",)}, "decode URLs need discovery static"),
        ({**PD, "read_timeout_s": 0.0}, "read_timeout_s must be > 0 seconds"),
        ({**PD, "max_in_flight": 0}, "max_in_flight must be >= 1"),
        ({**PD, "max_queued": -1}, "max_queued must be >= 0"),
        ({**PD, "discovery": "dns"}, r"discovery must be one of \['static', 'kubernetes'\]"),
    ],
)
def test_bad_static_values_name_the_field(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RouterConfig(**kwargs)


def test_router_command_refuses_bad_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["router", "--prefill-selector", "a", "--decode-selector", "b", "--port", "0"]) == 2
    assert capsys.readouterr().err == "error: port must be in 1..65535, got 0\n"
    with pytest.raises(SystemExit) as exit_info:
        main(["router", "--disaggregation", "sometimes"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'sometimes'" in capsys.readouterr().err
    assert main(["router", "--discovery", "static", "--decode", "http://d:1"]) == 2
    assert capsys.readouterr().err == (
        "error: decode URLs with disaggregation always need at least one prefill URL"
        " (or use --disaggregation never)\n"
    )


def test_router_import_path_loads_no_torch_engine_or_operator() -> None:
    code = (
        "import sys, fleetserve.router.cli, fleetserve.router.app;"
        "loaded = {m for m in sys.modules if m.split('.')[0] in ('torch', 'triton', 'kopf',"
        " 'transformers')"
        " or m.startswith(('fleetserve.engine', 'fleetserve.server', 'fleetserve.operator',"
        " 'fleetserve.kernels'))};"
        "assert not loaded, sorted(loaded)"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
