"""One surface for the engine's arguments: `EngineArgs` fields = `fleetserve serve` flags =
`LLM` keywords, and every flag the operator renders into a pod is one of them and parses."""

from __future__ import annotations

import argparse
import inspect
from pathlib import Path

import pytest
import yaml

from fleetserve import LLM
from fleetserve.api.models import InferenceDeploymentSpec
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.operator.render import engine_args
from fleetserve.server.cli import register

SAMPLES = Path(__file__).resolve().parents[1] / "manifests" / "samples"
SERVER_ONLY = {
    "host",
    "port",
    "served_model_name",
    "api_key",
    "max_waiting_requests",
    "max_prompts_per_request",
    "max_pending_outputs",
    "stats_log_interval",
}


def _serve_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    register(parser.add_subparsers(dest="command"))
    return parser


def _serve_destinations() -> set[str]:
    parser = _serve_parser()
    serve = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices[
        "serve"
    ]
    return {a.dest for a in serve._actions if a.dest != "help"}


def test_serve_flags_llm_keywords_and_engine_args_are_one_set() -> None:
    fields = set(EngineArgs.names())
    assert _serve_destinations() - SERVER_ONLY == fields
    assert set(inspect.signature(LLM).parameters) == fields


@pytest.mark.parametrize("sample", sorted(p.name for p in SAMPLES.glob("*.yaml")))
def test_every_flag_the_operator_renders_parses_as_an_engine_flag(sample: str) -> None:
    doc = yaml.safe_load((SAMPLES / sample).read_text())
    spec = InferenceDeploymentSpec.model_validate(doc["spec"])
    parser = _serve_parser()
    known = {"--" + name.replace("_", "-") for name in EngineArgs.names()}
    for role_name, role in spec.roles.items():
        argv = engine_args(spec, role_name, role)
        rendered = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
        engine_flags = rendered - {"--" + n.replace("_", "-") for n in SERVER_ONLY}
        assert engine_flags <= known | {"--no-" + f[2:] for f in known}, sorted(engine_flags)
        # The pod's shell expands $(FLEETSERVE_POD_IP); any value parses for --host.
        parsed = parser.parse_args(argv)
        assert parsed.command == "serve"
        EngineArgs.from_cli_args(parsed)  # every field is present after parsing
