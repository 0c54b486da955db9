"""`fleetserve serve --speculative-config ...` speculates and exports vllm:spec_decode_* on
/metrics (a real server process over a tiny model)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import requests

from tests.server.server_process import ServerHandle, start_server

SPEC = {"method": "ngram", "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path
) -> Iterator[ServerHandle]:
    yield from start_server(
        tmp_path_factory.mktemp("spec-server"),
        "--speculative-config",
        json.dumps(SPEC),
        "--dtype",
        "float32",
        model=str(tiny_llama_dir),
        max_model_len=256,
    )


def test_speculating_server_exports_acceptance_counters(server: ServerHandle) -> None:
    before = server.metrics()
    assert before["vllm:spec_decode_num_drafts_total"] == 0
    prompt = [10, 11, 12, 13, 14] * 8  # repeats: prompt lookup drafts from it
    body = {
        "model": server.model_name,
        "prompt": prompt,
        "max_tokens": 16,
        "temperature": 0,
        "ignore_eos": True,
    }
    reply = requests.post(
        f"{server.base_url}/v1/completions", json=body, headers=server.headers, timeout=60
    )
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 16
    after = server.metrics()
    assert after["vllm:spec_decode_num_drafts_total"] > 0
    assert (
        after["vllm:spec_decode_num_draft_tokens_total"]
        >= after["vllm:spec_decode_num_drafts_total"]
    )
    assert "vllm:spec_decode_num_accepted_tokens_total" in after
    assert "vllm:spec_decode_num_accepted_tokens_per_pos_total" in after
