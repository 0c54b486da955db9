"""Plugins in a real `fleetserve serve`: general plugins run once in the API server process and
once in the engine core process, the server plugin loads only in the API server and is served
because it is allowlisted, failing plugins do not stop start-up, `GET /v1/plugins` lists what
loaded, and an out-of-tree architecture registered by a plugin serves completions."""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.engine.tiny_models import make_tiny_model
from tests.plugins.plugin_package import write_plugin_package
from tests.server.server_process import ServerHandle, start_server

pytestmark = pytest.mark.slow

ALLOW = "general_ok,general_raises,broken_import,hello"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ServerHandle, Path]]:
    tmp = tmp_path_factory.mktemp("plugin-serving")
    root = write_plugin_package(tmp / "site")
    model = make_tiny_model(tmp, "llama")
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["TinyOotForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    log = tmp / "events"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
        mp.setenv("FSPLUG_LOG", str(log))
        mp.setenv("FLEETSERVE_PLUGINS", ALLOW)
        server = start_server(tmp, "--num-kv-blocks", "64", "--dtype", "float32",
                              model=str(model), max_model_len=128)  # fmt: skip
        handle = next(server)
        try:
            yield handle, log
        finally:
            server.close()


def test_each_group_loads_once_where_stated_and_failures_do_not_stop_start_up(
    served: tuple[ServerHandle, Path],
) -> None:
    handle, log = served
    events = Counter(tuple(line.split()) for line in log.read_text().splitlines())
    api, core = handle.process.pid, handle.engine_core_pid()
    assert events == {
        ("general_ok", str(api)): 1, ("general_raises", str(api)): 1,
        ("general_ok", str(core)): 1, ("general_raises", str(core)): 1,
        ("server_import", str(api)): 1,  # the API server only
    }  # fmt: skip
    text = handle.log_path.read_text()
    assert "Failed to load plugin broken_import" in text
    assert "Failed to load plugin general_raises" in text


def test_the_allowlisted_endpoint_is_served_and_plugins_are_listed(
    served: tuple[ServerHandle, Path],
) -> None:
    handle, _ = served
    assert requests.get(f"{handle.base_url}/hello", timeout=10).json() == {"hello": "from a plugin"}
    reply = requests.get(f"{handle.base_url}/v1/plugins", headers=handle.headers, timeout=10)
    listed = reply.json()["data"]
    assert {(p["name"], p["status"]) for p in listed} == {
        ("general_ok", "loaded"), ("general_raises", "failed"), ("broken_import", "failed"),
        ("hello", "loaded"),
    }  # fmt: skip


def test_an_out_of_tree_architecture_from_a_plugin_serves_a_completion(
    served: tuple[ServerHandle, Path],
) -> None:
    handle, _ = served
    body = {"model": handle.model_name, "prompt": [5, 6, 7, 8], "max_tokens": 4,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    reply = requests.post(f"{handle.base_url}/v1/completions", json=body,
                          headers=handle.headers, timeout=60)  # fmt: skip
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 4
