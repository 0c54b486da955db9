"""`--generation-config auto|vllm|FOLDER`: where sampling defaults come from, request values
winning over them, the effective values logged; through `LLM` and the server's request mapping."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from fleetserve import LLM
from fleetserve.engine.generation_config import GenerationDefaults, load_generation_defaults
from fleetserve.openai.protocol import ChatCompletionRequest, CompletionRequest
from fleetserve.server.sampling import chat_sampling_params, completion_sampling_params

SAMPLING = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "max_new_tokens": 3,
            "repetition_penalty": 1.1, "do_sample": True, "bos_token_id": 1}  # fmt: skip


@pytest.fixture(scope="module")
def model_with_defaults(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("gen") / "tiny"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps(SAMPLING))
    return folder


def test_sources_resolve_and_the_effective_values_are_logged(
    model_with_defaults: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="fleetserve.engine.generation_config"):
        auto = load_generation_defaults("auto", str(model_with_defaults))
    assert auto.overrides() == {"temperature": 0.6, "top_p": 0.9, "top_k": 20,
                                "repetition_penalty": 1.1, "max_tokens": 3}  # fmt: skip
    assert "'temperature': 0.6" in caplog.text and "generation_config.json" in caplog.text
    assert load_generation_defaults("vllm", str(model_with_defaults)).overrides() == {}
    assert load_generation_defaults(str(model_with_defaults), str(tmp_path)) == auto
    assert load_generation_defaults("auto", str(tmp_path)) == GenerationDefaults()  # no file
    with pytest.raises(ValueError, match="generation_config must be one of"):
        load_generation_defaults(str(tmp_path), str(model_with_defaults))
    (tmp_path / "generation_config.json").write_text('{"temperature": "hot"}')
    with pytest.raises(ValueError, match="temperature must be a number"):
        load_generation_defaults(str(tmp_path), str(model_with_defaults))


def test_request_values_override_the_defaults_over_http_bodies(model_with_defaults: Path) -> None:
    defaults = load_generation_defaults("auto", str(model_with_defaults))
    unset = completion_sampling_params(CompletionRequest(model="m", prompt="hi"), defaults)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.max_tokens) == (0.6, 0.9, 20, 3)
    explicit = completion_sampling_params(
        CompletionRequest(model="m", prompt="hi", temperature=1.0, top_k=0, max_tokens=16),
        defaults,
    )
    assert (explicit.temperature, explicit.top_k, explicit.max_tokens) == (1.0, 0, 16)
    chat = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    params = chat_sampling_params(chat, default_max_tokens=100, defaults=defaults)
    assert (params.repetition_penalty, params.max_tokens) == (1.1, 3)
    neutral = completion_sampling_params(CompletionRequest(model="m", prompt="hi"))
    assert (neutral.temperature, neutral.top_k, neutral.max_tokens) == (1.0, 0, 16)


def test_llm_uses_the_model_defaults_unless_vllm_is_asked(model_with_defaults: Path) -> None:
    prompt = {"prompt_token_ids": [5, 6, 7]}
    llm = LLM(str(model_with_defaults), dtype="float32", max_model_len=64, num_kv_blocks=16)
    assert llm.get_default_sampling_params().temperature == 0.6
    (out,) = llm.generate([prompt])
    assert len(out.outputs[0].token_ids) <= 3  # max_new_tokens from generation_config.json
    neutral = LLM(str(model_with_defaults), dtype="float32", max_model_len=64, num_kv_blocks=16,
                  generation_config="vllm")  # fmt: skip
    assert neutral.get_default_sampling_params().temperature == 1.0
    assert neutral.config.generation.overrides() == {}
    (longer,) = neutral.generate([prompt])
    assert len(longer.outputs[0].token_ids) > 3  # SamplingParams' own max_tokens (16)
