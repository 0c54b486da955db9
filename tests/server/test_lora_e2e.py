"""LoRA through the real server and engine core process: a request's `model` selects its
adapter (its `LoRARequest` crosses the process boundary), a runtime-loaded adapter serves at
once, and each answer is transformers + peft's with that adapter merged."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from fleetserve.engine.config import EngineConfig
from fleetserve.server.app import ServerConfig, create_app
from tests.engine.lora.adapters import make_adapter, peft_greedy
from tests.engine.tiny_models import make_prompts, make_tiny_model
from tests.server.fake_engine import run_client

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("lora-e2e")
    base = make_tiny_model(root, "llama")
    a = make_adapter(base, root / "a", seed=11, target_modules=["q_proj", "v_proj"])
    b = make_adapter(base, root / "b", seed=12, target_modules=["gate_proj", "down_proj"])
    return base, a, b


@pytest.mark.slow
def test_the_served_adapters_answer_as_peft_merged(tiny: tuple[Path, Path, Path]) -> None:
    base, a, b = tiny
    engine = EngineConfig.create(
        str(base), dtype="float32", max_model_len=128, num_kv_blocks=32, enable_lora=True,
        max_loras=2, max_lora_rank=8, lora_modules=[f"a={a}"],
    )  # fmt: skip
    config = ServerConfig(
        engine=engine,
        served_model_name="tiny",
        stats_log_interval_s=0,
        allow_runtime_lora_updating=True,
        skip_tokenizer_init=True,
    )
    prompt = make_prompts(512, [21], seed=5)[0]

    async def scenario(client: TestClient[Any, Any]) -> dict[str, list[int]]:
        loaded = await client.post(
            "/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(b)}
        )
        assert loaded.status == 200, await loaded.text()
        tokens: dict[str, list[int]] = {}
        for model in ("a", "tiny", "b"):
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0, "model": model}
            response = await client.post("/v1/completions", json=body)
            assert response.status == 200, await response.text()
            result = await response.json()
            assert result["model"] == model
            tokens[model] = result["choices"][0]["token_ids"]
        return tokens

    tokens = run_client(create_app(config), scenario)
    assert tokens["tiny"] == peft_greedy(base, None, [prompt], MAX_TOKENS)[0]
    assert tokens["a"] == peft_greedy(base, a, [prompt], MAX_TOKENS)[0]
    assert tokens["b"] == peft_greedy(base, b, [prompt], MAX_TOKENS)[0]
    assert len({tuple(t) for t in tokens.values()}) == 3
