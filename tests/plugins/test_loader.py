"""The plugin loader in this process, over a test package on sys.path: the allowlist filters,
server plugins are default-deny, failures are logged by name and skipped, a group loads once."""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from aiohttp import web

from fleetserve.engine.models import oot_registry
from fleetserve.envs import read_env
from fleetserve.plugins.loader import GENERAL_GROUP, SERVER_GROUP, PluginLoader
from tests.plugins.plugin_package import write_plugin_package


@pytest.fixture(scope="module")
def plugin_root(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = write_plugin_package(tmp_path_factory.mktemp("plugins"))
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    # NOTE: the general plugin registered its architecture in this process; later tests must
    # not see a class whose package left sys.path.
    oot_registry._REGISTERED.pop("TinyOotForCausalLM", None)
    for name in [m for m in sys.modules if m.split(".")[0] == "fsplug_test"]:
        del sys.modules[name]


def _status(loader: PluginLoader) -> dict[str, str]:
    return {r.name: r.status for r in loader.records()}


def _events(log: Path) -> list[str]:
    return [line.split()[0] for line in log.read_text().splitlines()] if log.exists() else []


def test_unset_allowlist_runs_general_plugins_isolating_failures(
    plugin_root: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    log = tmp_path / "events"
    monkeypatch.setenv("FSPLUG_LOG", str(log))
    loader = PluginLoader(environ={})
    with caplog.at_level(logging.INFO, logger="fleetserve.plugins.loader"):
        loader.run_general()
        loader.run_general()  # once per process
    assert _status(loader) == {
        "general_ok": "loaded", "general_raises": "failed", "broken_import": "failed",
    }  # fmt: skip
    assert _events(log) == ["general_ok", "general_raises"]
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "Failed to load plugin broken_import" in messages
    assert "Failed to load plugin general_raises" in messages
    assert "plugins loaded in this process" in messages and "'general_ok'" in messages
    from fleetserve.engine.models.registry import resolve_model_class

    assert resolve_model_class("TinyOotForCausalLM").__name__ == "TinyOotForCausalLM"


def test_server_plugins_are_denied_without_an_allowlist(
    plugin_root: Path, caplog: pytest.LogCaptureFixture
) -> None:
    loader = PluginLoader(environ={})
    app = web.Application()
    with caplog.at_level(logging.WARNING, logger="fleetserve.plugins.loader"):
        loader.apply_server(app)
    assert [r.status for r in loader.records() if r.group == SERVER_GROUP] == ["denied"]
    assert not [r for r in app.router.routes() if r.resource and r.resource.canonical == "/hello"]
    assert "not loaded without an allowlist" in caplog.text


def test_the_allowlist_filters_and_an_empty_one_allows_nothing(plugin_root: Path) -> None:
    only = PluginLoader(environ={"FLEETSERVE_PLUGINS": "general_ok,hello"})
    assert only.allowlist == ("general_ok", "hello")
    assert set(only.load_group(GENERAL_GROUP)) == {"general_ok"}
    app = web.Application()
    only.apply_server(app)
    assert {r.resource.canonical for r in app.router.routes() if r.resource} == {"/hello"}
    assert _status(only) == {"general_ok": "loaded", "general_raises": "denied",
                             "broken_import": "denied", "hello": "loaded"}  # fmt: skip
    empty = PluginLoader(environ={"FLEETSERVE_PLUGINS": ""})
    assert empty.allowlist == ()
    assert empty.load_group(GENERAL_GROUP) == {}
    assert set(_status(empty).values()) == {"denied"}
    with pytest.raises(ValueError, match="group must be one of"):
        empty.load_group("fleetserve.nope")


def test_empty_plugins_variable_is_a_value_not_unset() -> None:
    assert read_env({"FLEETSERVE_PLUGINS": ""}).plugins == ""
    assert read_env({}).plugins is None
    assert read_env({"FLEETSERVE_CACHE": ""}).cache is None  # others: empty is unset
