from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from fleetserve.api.cli import register as register_crds
from fleetserve.api.crd import crd_yaml
from fleetserve.operator.cli import register as register_operator


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fleetserve")
    sub = parser.add_subparsers(dest="command", required=True)
    register_crds(sub)
    register_operator(sub)
    return parser


def test_crds_prints_the_crd(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parser().parse_args(["crds"])
    assert args.func(args) == 0
    assert capsys.readouterr().out == crd_yaml()


def test_crds_writes_a_file(tmp_path: Path) -> None:
    args = _parser().parse_args(["crds", "-o", str(tmp_path / "crd.yaml")])
    assert args.func(args) == 0
    assert (tmp_path / "crd.yaml").read_text() == crd_yaml()


def test_operator_defaults_standalone_clusterwide_with_liveness() -> None:
    args = _parser().parse_args(["operator"])
    assert (args.namespace, args.peering, args.liveness) == (
        [],
        None,
        "http://0.0.0.0:8080/healthz",
    )
    args = _parser().parse_args(["operator", "-n", "a", "-n", "b", "--peering", "p"])
    assert (args.namespace, args.peering) == (["a", "b"], "p")
