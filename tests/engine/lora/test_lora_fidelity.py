"""Acceptance 1 (issue 21): adapters served by the engine decode exactly as transformers with
the adapter merged by peft, in one batch mixing adapters and the base model; a third adapter
over max_loras 2 evicts by LRU; two adapters never share KV blocks."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetserve import LLM, SamplingParams
from fleetserve.engine.lora.request import LoRARequest
from fleetserve.engine.lora.runner import LoRARunner
from tests.engine.lora.adapters import TinyLoRAs, peft_greedy
from tests.engine.tiny_models import make_prompts

MAX_TOKENS = 8
PARAMS = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def lora(name: str, lora_id: int, path: Path) -> LoRARequest:
    return LoRARequest(name, lora_id, str(path))


@pytest.fixture(scope="module")
def llm(tiny_loras: TinyLoRAs) -> LLM:
    return LLM(
        str(tiny_loras.base), dtype="float32", max_model_len=256, enable_lora=True,
        max_loras=2, max_cpu_loras=2, max_lora_rank=8, num_kv_blocks=64,
    )  # fmt: skip


def runner_lora(llm: LLM) -> LoRARunner:
    lora_runner = llm.engine_core.executor.worker.model_runner.lora  # type: ignore[attr-defined]
    assert lora_runner is not None
    return lora_runner


def generate(
    llm: LLM, prompts: list[list[int]], loras: list[LoRARequest | None]
) -> list[list[int]]:
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], PARAMS, lora_request=loras)
    return [o.outputs[0].token_ids for o in outputs]


def expected(
    tiny_loras: TinyLoRAs, prompts: list[list[int]], loras: list[LoRARequest | None]
) -> list[list[int]]:
    return [
        peft_greedy(tiny_loras.base, None if r is None else Path(r.lora_path), [p], MAX_TOKENS)[0]
        for p, r in zip(prompts, loras, strict=True)
    ]


def test_a_batch_mixing_two_adapters_and_the_base_matches_peft_merged(
    llm: LLM, tiny_loras: TinyLoRAs
) -> None:
    a, b = lora("a", 1, tiny_loras.a), lora("b", 2, tiny_loras.b)
    # Each prompt under the base model and both adapters, in one batch (one step mixes all).
    prompts = [p for p in make_prompts(512, [5, 19, 40], seed=1) for _ in range(3)]
    loras: list[LoRARequest | None] = [None, a, b] * 3
    want = expected(tiny_loras, prompts, loras)
    assert generate(llm, prompts, loras) == want
    for i in range(0, 9, 3):  # the adapters really change the output
        assert want[i] != want[i + 1] and want[i] != want[i + 2] and want[i + 1] != want[i + 2]


def test_a_third_adapter_over_max_loras_2_evicts_the_lru_one_and_answers_right(
    llm: LLM, tiny_loras: TinyLoRAs
) -> None:
    a, b, c = lora("a", 1, tiny_loras.a), lora("b", 2, tiny_loras.b), lora("c", 3, tiny_loras.c)
    prompts = make_prompts(512, [7, 23], seed=2)
    generate(llm, prompts, [a, b])
    generate(llm, prompts[:1], [b])  # b is now the most recently used
    manager = runner_lora(llm).manager
    assert manager.registered_ids == [1, 2]
    loras: list[LoRARequest | None] = [c, None]
    assert generate(llm, prompts, loras) == expected(tiny_loras, prompts, loras)
    assert manager.registered_ids == [2, 3], "a (least recently used) was evicted"
    assert sorted(i for i in manager.lora_index_to_id if i is not None) == [2, 3]
    # And a comes back (reloaded from its folder) in a batch with c, evicting b.
    loras = [a, c]
    assert generate(llm, prompts, loras) == expected(tiny_loras, prompts, loras)
    assert sorted(manager.registered_ids) == [1, 3]


def test_the_same_prompt_under_two_adapters_shares_no_kv_blocks(
    llm: LLM, tiny_loras: TinyLoRAs
) -> None:
    a, b = lora("a", 1, tiny_loras.a), lora("b", 2, tiny_loras.b)
    prompt = make_prompts(512, [70], seed=3)[0]  # 4 full blocks of 16
    first = llm.generate([{"prompt_token_ids": prompt}], PARAMS, lora_request=a)[0]
    other = llm.generate([{"prompt_token_ids": prompt}], PARAMS, lora_request=b)[0]
    base = llm.generate([{"prompt_token_ids": prompt}], PARAMS)[0]
    again = llm.generate([{"prompt_token_ids": prompt}], PARAMS, lora_request=a)[0]
    assert first.num_cached_tokens == 0
    assert other.num_cached_tokens == 0, "b must not hit a's blocks"
    assert base.num_cached_tokens == 0, "the base model must not hit an adapter's blocks"
    assert again.num_cached_tokens >= 64, "a hits its own blocks"
    assert again.outputs[0].token_ids == first.outputs[0].token_ids


def test_max_loras_1_makes_the_second_adapter_wait_not_fail(tiny_loras: TinyLoRAs) -> None:
    llm = LLM(
        str(tiny_loras.base), dtype="float32", max_model_len=256, enable_lora=True,
        max_loras=1, max_cpu_loras=2, max_lora_rank=8, num_kv_blocks=64,
    )  # fmt: skip
    a, b = lora("a", 1, tiny_loras.a), lora("b", 2, tiny_loras.b)
    prompts = make_prompts(512, [9, 12, 30, 4], seed=4)
    loras: list[LoRARequest | None] = [a, b, a, None]
    assert generate(llm, prompts, loras) == expected(tiny_loras, prompts, loras)


def test_a_bad_adapter_folder_is_refused_before_anything_runs(llm: LLM, tmp_path: Path) -> None:
    bad = LoRARequest("bad", 9, str(tmp_path / "missing"))
    with pytest.raises(ValueError, match=r"LoRA adapter 'bad'.*PEFT folder"):
        llm.generate([{"prompt_token_ids": [5, 6, 7]}], PARAMS, lora_request=bad)
    assert not llm.has_unfinished_requests()
