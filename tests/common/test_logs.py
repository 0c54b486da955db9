"""The commands' logging: one format, a named error for a bad --log-level, and the operator's
lines about an object led by `[namespace/name]` as under `kopf run` (in fresh subprocesses, since
logging is configured once per process)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from fleetserve.common.logs import configure_logging


def test_a_bad_level_names_the_flag_and_the_levels() -> None:
    with pytest.raises(ValueError, match=r"--log-level must be one of debug, info, .* got 'loud'"):
        configure_logging("loud")


def _stderr(code: str) -> str:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stderr


def test_commands_log_in_one_format_at_the_level_given() -> None:
    err = _stderr(
        "import logging\n"
        "from fleetserve.common.logs import configure_logging\n"
        "configure_logging('Warning')\n"
        "logging.getLogger('fleetserve.x').info('quiet')\n"
        "logging.getLogger('fleetserve.x').warning('said')\n"
    )
    (line,) = err.splitlines()
    assert line.endswith(" WARNING fleetserve.x: said")


@pytest.mark.parametrize(("level", "shown"), [("info", True), ("warning", False)])
def test_the_operator_names_the_object_once_per_line(level: str, shown: bool) -> None:
    err = _stderr(
        "import kopf\n"
        "from fleetserve.common.logs import configure_logging\n"
        "from fleetserve.operator.cli import log_like_kopf_run\n"
        f"configure_logging({level!r})\n"
        "log_like_kopf_run()\n"
        "body = {'metadata': {'namespace': 'ns', 'name': 'big'}}\n"
        "kopf.LocalObjectLogger(body=body, settings=kopf.OperatorSettings()).info('reconciled')\n"
    )
    lines = [line for line in err.splitlines() if "reconciled" in line]
    assert len(lines) == (1 if shown else 0), err
    if shown:
        assert lines[0].endswith("[ns/big] reconciled")
