"""A model folder without a tokenizer (issue 13): loading it names the missing files, and with
`skip_tokenizer_init` the engine serves token ids in and token ids out, offline and over HTTP,
refusing every text field with a 400 that says why."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests

from fleetserve import LLM, SamplingParams
from fleetserve.engine.tokenizer import load_tokenizer
from tests.engine.tiny_models import make_tiny_model
from tests.server.server_process import ServerHandle, start_server

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
PROMPT_IDS = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def bare_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model with its weights and configs but no tokenizer files."""
    model = make_tiny_model(tmp_path_factory.mktemp("bare"), "llama")
    for name in TOKENIZER_FILES:
        (model / name).unlink(missing_ok=True)
    return model


@pytest.fixture(scope="module")
def expected(bare_model: Path, tmp_path_factory: pytest.TempPathFactory) -> list[int]:
    """Greedy ids of the same weights, generated with the tokenizer present."""
    with_tokenizer = tmp_path_factory.mktemp("full") / "model"
    shutil.copytree(bare_model, with_tokenizer)
    full = make_tiny_model(tmp_path_factory.mktemp("tok"), "llama")
    for name in TOKENIZER_FILES:
        shutil.copy(full / name, with_tokenizer / name)
    llm = LLM(str(with_tokenizer), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": PROMPT_IDS}], params)[0].outputs[0].token_ids


def test_a_missing_tokenizer_is_named(bare_model: Path) -> None:
    for load in (lambda: load_tokenizer(bare_model), lambda: LLM(str(bare_model))):
        with pytest.raises(ValueError) as info:
            load()
        message = str(info.value)
        assert str(bare_model) in message and "tokenizer.json" in message, message
        assert "skip_tokenizer_init" in message


def test_offline_token_ids_in_and_out(bare_model: Path, expected: list[int]) -> None:
    llm = LLM(str(bare_model), dtype="float32", skip_tokenizer_init=True)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    (output,) = llm.generate([{"prompt_token_ids": PROMPT_IDS}], params)
    assert output.outputs[0].token_ids == expected and output.outputs[0].text == ""
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.generate(["text needs a tokenizer"], params)
    with pytest.raises(ValueError, match="stop"):
        llm.generate([{"prompt_token_ids": PROMPT_IDS}], SamplingParams(stop=["x"]))
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm.chat([{"role": "user", "content": "hi"}])


@pytest.fixture(scope="module")
def server(bare_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerHandle]:
    yield from start_server(
        tmp_path_factory.mktemp("skip"), "--skip-tokenizer-init", model=str(bare_model),
        max_model_len=128,
    )  # fmt: skip


def _post(server: ServerHandle, path: str, body: dict[str, Any]) -> requests.Response:
    return requests.post(f"{server.base_url}{path}", json=body, headers=server.headers, timeout=60)


@pytest.mark.slow
def test_the_server_serves_token_ids(server: ServerHandle, expected: list[int]) -> None:
    body = {"prompt": PROMPT_IDS, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    response = _post(server, "/v1/completions", body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["token_ids"] == expected and choice["text"] == ""
    assert choice["prompt_token_ids"] == PROMPT_IDS
    stream = _post(server, "/v1/completions", {**body, "stream": True})
    ids = [
        t
        for line in stream.text.split("\n\n")
        if line.startswith("data: {")
        for c in json.loads(line[6:])["choices"]
        for t in c["token_ids"] or []
    ]
    assert ids == expected and stream.text.rstrip().endswith("data: [DONE]")


@pytest.mark.slow
@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": "text"}, "prompt"),
        ("/v1/completions", {"prompt": ["a", "b"]}, "prompt"),
        ("/v1/completions", {"prompt": PROMPT_IDS, "stop": ["x"]}, "stop"),
        ("/v1/completions", {"prompt": PROMPT_IDS, "logprobs": 1}, "logprobs"),
        ("/v1/completions", {"prompt": PROMPT_IDS, "echo": True}, "echo"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
        ("/tokenize", {"prompt": "hi"}, "prompt"),
        ("/detokenize", {"tokens": [5]}, "tokens"),
    ],
)
def test_text_fields_are_refused(server: ServerHandle, path: str, body: Any, param: str) -> None:
    response = _post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and "skip_tokenizer_init" in error["message"], error
