"""LoRA over HTTP: `model` selects the adapter, /v1/models lists the adapters under their base,
and /v1/load_lora_adapter and /v1/unload_lora_adapter change them only when runtime updates are
allowed (in-process, over the fake engine: what the server hands the engine is checked)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.lora.request import LoRARequest
from fleetserve.server.app import ServerConfig, create_app
from tests.server.fake_engine import MODEL_NAME, FakeEngineClient, run_client

Scenario = Callable[[TestClient[Any, Any]], Any]


def write_adapter(folder: Path, r: int = 8) -> Path:
    """A PEFT folder as the server checks it (the config; the worker would read the weights)."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": r, "lora_alpha": 16, "target_modules": ["q_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    (folder / "adapter_model.safetensors").write_bytes(b"")
    return folder


@pytest.fixture(scope="module")
def lora_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters")
    for name in ("sql", "chat", "other"):
        write_adapter(root / name)
    write_adapter(root / "wide", r=64)
    return root


@pytest.fixture(scope="module")
def lora_config(lora_dir: Path) -> EngineConfig:
    from fleetserve.engine.models.bundled import bundled_model_path

    return EngineConfig.create(
        str(bundled_model_path()), device="cpu", max_model_len=512, enable_lora=True,
        max_loras=2, max_lora_rank=16, lora_modules=[f"sql={lora_dir / 'sql'}"],
    )  # fmt: skip


def serve(
    lora_config: EngineConfig, tokenizer: Any, scenario: Scenario, *, allow: bool = False
) -> tuple[Any, FakeEngineClient]:
    engine = FakeEngineClient(lora_config, tokenizer)
    config = ServerConfig(
        engine=lora_config,
        served_model_name=MODEL_NAME,
        stats_log_interval_s=0,
        allow_runtime_lora_updating=allow,
    )
    app: web.Application = create_app(config, engine_client=engine)
    return run_client(app, scenario), engine


async def models(client: TestClient[Any, Any]) -> list[dict[str, Any]]:
    response = await client.get("/v1/models")
    assert response.status == 200
    return list((await response.json())["data"])


async def complete(client: TestClient[Any, Any], model: str) -> tuple[int, dict[str, Any]]:
    response = await client.post(
        "/v1/completions", json={"prompt": "hi", "max_tokens": 3, "model": model}
    )
    return response.status, await response.json()


def test_models_lists_the_start_up_adapters_with_the_base_as_parent(
    lora_config: EngineConfig, tokenizer: Any, lora_dir: Path
) -> None:
    cards, _ = serve(lora_config, tokenizer, models)
    assert [(c["id"], c["parent"]) for c in cards] == [(MODEL_NAME, None), ("sql", MODEL_NAME)]
    assert cards[1]["root"] == str(lora_dir / "sql")


def test_the_model_field_selects_the_adapter(lora_config: EngineConfig, tokenizer: Any) -> None:
    async def scenario(client: TestClient[Any, Any]) -> list[Any]:
        return [await complete(client, "sql"), await complete(client, MODEL_NAME)]

    (sql, base), engine = serve(lora_config, tokenizer, scenario)
    assert (sql[0], sql[1]["model"]) == (200, "sql")
    assert (base[0], base[1]["model"]) == (200, MODEL_NAME)
    adapter = engine.calls[0].lora_request
    assert isinstance(adapter, LoRARequest) and adapter.lora_name == "sql"
    assert engine.calls[1].lora_request is None


def test_an_unknown_model_is_a_400_naming_the_served_ones(
    lora_config: EngineConfig, tokenizer: Any
) -> None:
    (status, body), engine = serve(lora_config, tokenizer, lambda c: complete(c, "nope"))
    assert status == 400
    assert body["error"]["code"] == "model_not_found"
    assert f"'{MODEL_NAME}', 'sql'" in body["error"]["message"]
    assert engine.calls == []


def test_runtime_updates_are_refused_unless_allowed(
    lora_config: EngineConfig, tokenizer: Any, lora_dir: Path
) -> None:
    async def scenario(client: TestClient[Any, Any]) -> list[Any]:
        body = {"lora_name": "chat", "lora_path": str(lora_dir / "chat")}
        load = await client.post("/v1/load_lora_adapter", json=body)
        unload = await client.post("/v1/unload_lora_adapter", json={"lora_name": "sql"})
        return [load.status, (await load.json())["error"]["message"], unload.status]

    (load, message, unload), _ = serve(lora_config, tokenizer, scenario)
    assert (load, unload) == (400, 400)
    assert "FLEETSERVE_ALLOW_RUNTIME_LORA_UPDATING=1" in message


def test_load_and_unload_change_what_is_served(
    lora_config: EngineConfig, tokenizer: Any, lora_dir: Path
) -> None:
    chat = {"lora_name": "chat", "lora_path": str(lora_dir / "chat")}

    async def scenario(client: TestClient[Any, Any]) -> dict[str, Any]:
        seen: dict[str, Any] = {}
        response = await client.post("/v1/load_lora_adapter", json=chat)
        seen["load"] = (response.status, await response.text())
        seen["models"] = [c["id"] for c in await models(client)]
        seen["complete"] = await complete(client, "chat")
        again = await client.post("/v1/load_lora_adapter", json=chat)
        seen["again"] = (again.status, (await again.json())["error"]["message"])
        response = await client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
        seen["unload"] = (response.status, await response.text())
        seen["after"] = [c["id"] for c in await models(client)]
        seen["gone"] = (await complete(client, "chat"))[0]
        missing = await client.post("/v1/unload_lora_adapter", json={"lora_name": "chat"})
        seen["missing"] = missing.status
        moved = {"lora_name": "chat", "lora_path": str(lora_dir / "other")}
        response = await client.post("/v1/load_lora_adapter", json=moved)
        seen["moved"] = (response.status, (await response.json())["error"]["message"])
        response = await client.post("/v1/load_lora_adapter", json=chat)
        seen["back"] = response.status
        return seen

    seen, engine = serve(lora_config, tokenizer, scenario, allow=True)
    assert seen["load"] == (200, "Success: LoRA adapter 'chat' added successfully.")
    assert seen["models"] == [MODEL_NAME, "sql", "chat"]
    assert seen["complete"][0] == 200
    assert engine.calls[0].lora_request == LoRARequest("chat", 2, str(lora_dir / "chat"))
    assert seen["again"] == (400, "The lora adapter 'chat' has already been loaded.")
    assert seen["unload"] == (200, "Success: LoRA adapter 'chat' removed successfully.")
    assert seen["after"] == [MODEL_NAME, "sql"]
    assert (seen["gone"], seen["missing"]) == (400, 404)
    assert seen["moved"][0] == 400 and "choose a new name" in seen["moved"][1]
    assert seen["back"] == 200, "the same folder under its old name is fine"


@pytest.mark.parametrize(
    ("body", "param", "message"),
    [
        ({"lora_name": "w", "lora_path": "/nonexistent"}, "lora_path", "PEFT folder"),
        ({"lora_name": "w", "lora_path": "WIDE"}, "lora_path", "rank 64, above max_lora_rank"),
        ({"lora_name": "", "lora_path": "/x"}, "lora_name", ""),
        ({"lora_name": MODEL_NAME, "lora_path": "SQL"}, "lora_name", "already been loaded"),
    ],
)
def test_a_bad_load_is_a_400_naming_the_field(
    lora_config: EngineConfig,
    tokenizer: Any,
    lora_dir: Path,
    body: dict[str, str],
    param: str,
    message: str,
) -> None:
    paths = {"WIDE": str(lora_dir / "wide"), "SQL": str(lora_dir / "sql")}
    body = {k: paths.get(v, v) for k, v in body.items()}

    async def scenario(client: TestClient[Any, Any]) -> tuple[int, dict[str, Any]]:
        response = await client.post("/v1/load_lora_adapter", json=body)
        return response.status, (await response.json())["error"]

    (status, error), _ = serve(lora_config, tokenizer, scenario, allow=True)
    assert (status, error["param"]) == (400, param)
    assert message in error["message"]
