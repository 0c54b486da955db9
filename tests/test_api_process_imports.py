"""What the API server process loads, checked in fresh subprocesses through `sys.modules`.

Importing the server (the app, the CLI, the engine client, prompt validation) loads no torch.
A serving API process does load torch, legitimately: transformers imports it when the
tokenizer's config is loaded (`transformers.configuration_utils` → `modeling_rope_utils`). So
the serving check is the narrower statement of the process split (docs/architecture.md): the API
process never loads the engine core's own modules (`engine_core`, the scheduler, the workers,
the models, the layers, the kernels), only the spawn target and the wire types of
`fleetserve.engine.core`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.engine.tiny_models import make_tiny_model

CORE_MODULES_THE_API_PROCESS_MAY_LOAD = {
    "fleetserve.engine.core",
    "fleetserve.engine.core.engine_core_proc",  # the spawn target (run_engine_core)
    "fleetserve.engine.core.messages",
    "fleetserve.engine.core.outputs",
}
# NOTE: torch-free readers of config.json that the engine arguments' checks need in this process
# (whether a model is MoE, for expert parallel and EPLB); nothing else of the packages below.
ENGINE_SIDE_MODULES_THE_API_PROCESS_MAY_LOAD = {
    "fleetserve.engine.models",
    "fleetserve.engine.models.moe_arch",
}
ENGINE_SIDE_PACKAGES = (
    "fleetserve.engine.worker",
    "fleetserve.engine.models",
    "fleetserve.engine.layers",
    "fleetserve.kernels",
)


def _run(code: str, *args: str, timeout: float = 60) -> str:
    result = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout.strip().splitlines()[-1]


def test_the_api_server_modules_import_without_torch() -> None:
    code = (
        "import sys, json\n"
        "import fleetserve.server.app, fleetserve.server.cli\n"
        "import fleetserve.engine.async_llm, fleetserve.engine.validation\n"
        "print(json.dumps(sorted(m for m in sys.modules\n"
        "                        if m.split('.')[0] in ('torch', 'triton', 'transformers'))))\n"
    )
    assert json.loads(_run(code)) == []


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    yield make_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")


SERVE_ONE_CHAT_AND_ONE_STREAM = """
import asyncio, json, sys
from aiohttp.test_utils import TestClient, TestServer
from fleetserve.engine.config import EngineConfig
from fleetserve.server.app import ServerConfig, create_app

async def serve(model):
    config = EngineConfig.create(model, device="cpu", max_model_len=256)
    app = create_app(ServerConfig(engine=config, served_model_name="tiny", stats_log_interval_s=0))
    statuses = []
    async with TestClient(TestServer(app)) as client:
        chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        response = await client.post("/v1/chat/completions", json=chat)
        await response.read()
        statuses.append(response.status)
        stream = {"prompt": "hello", "max_tokens": 4, "stream": True, "logprobs": 2}
        response = await client.post("/v1/completions", json=stream)
        assert (await response.read()).rstrip().endswith(b"data: [DONE]")
        statuses.append(response.status)
    return statuses

if __name__ == "__main__":  # as a main module that spawns a process must
    statuses = asyncio.run(serve(sys.argv[1]))
    loaded = sorted(m for m in sys.modules if m.startswith("fleetserve."))
    print(json.dumps({"statuses": statuses, "fleetserve": loaded}))
"""


@pytest.mark.slow
def test_a_serving_api_process_never_loads_the_engine_core(tiny_model: Path) -> None:
    """A chat request and a streamed completion, served by the app with a real engine core;
    afterwards the API process holds none of the core's own modules."""
    report = json.loads(_run(SERVE_ONE_CHAT_AND_ONE_STREAM, str(tiny_model), timeout=180))
    assert report["statuses"] == [200, 200]
    loaded = set(report["fleetserve"])
    assert "fleetserve.server.app" in loaded and "fleetserve.engine.async_llm" in loaded
    core = {m for m in loaded if m.startswith("fleetserve.engine.core")}
    assert core <= CORE_MODULES_THE_API_PROCESS_MAY_LOAD, sorted(core)
    assert "fleetserve.engine.core.engine_core" not in loaded
    engine_side = sorted(
        m
        for m in loaded
        if m.startswith(ENGINE_SIDE_PACKAGES)
        and m not in ENGINE_SIDE_MODULES_THE_API_PROCESS_MAY_LOAD
    )
    assert engine_side == [], engine_side
