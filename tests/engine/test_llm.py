"""The offline API end to end on a tiny random model: validation, abort, n > 1, stops, seeds."""

from __future__ import annotations

from pathlib import Path

import pytest

from fleetserve import LLM, SamplingParams
from tests.engine.tiny_models import make_tiny_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> LLM:
    path: Path = make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")
    return LLM(str(path), dtype="float32", max_model_len=128, num_kv_blocks=64)


PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9, 10, 11]}


@pytest.mark.parametrize(
    ("prompt", "params", "field"),
    [
        ({"prompt_token_ids": []}, SamplingParams(), "prompt"),
        ({"prompt_token_ids": list(range(3, 200))}, SamplingParams(), "max_model_len"),
        (PROMPT, {"max_tokens": 0}, "max_tokens"),
        (PROMPT, {"max_tokens": -3}, "max_tokens"),
        (PROMPT, {"temperature": -0.5}, "temperature"),
        (PROMPT, {"top_p": 0.0}, "top_p"),
        (PROMPT, {"top_p": 1.5}, "top_p"),
        (PROMPT, {"bogus_field": 1}, "bogus_field"),
    ],
)
def test_bad_input_raises_value_error_naming_the_field(
    llm: LLM, prompt: dict[str, list[int]], params: SamplingParams | dict[str, int], field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        sp = params if isinstance(params, SamplingParams) else SamplingParams(**params)
        llm.generate([prompt], sp)


def test_invalid_request_does_not_disturb_running_ones(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = llm.generate([PROMPT], greedy)[0].outputs[0].token_ids
    rid = llm.add_request(PROMPT["prompt_token_ids"], greedy)
    llm.step()
    with pytest.raises(ValueError):
        llm.add_request([], greedy)
    with pytest.raises(ValueError):
        llm.add_request([1, 2, 3], SamplingParams(logit_bias={10**9: 1.0}))
    done = {}
    while llm.has_unfinished_requests():
        done.update({o.request_id: o for o in llm.step()})
    assert done[rid].outputs[0].token_ids == expected


def test_abort_then_resubmit_same_id(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = llm.generate([PROMPT], greedy)[0].outputs[0].token_ids
    llm.add_request(PROMPT["prompt_token_ids"], greedy, request_id="same")
    llm.step()
    llm.step()
    llm.abort_request("same")
    llm.add_request(PROMPT["prompt_token_ids"], greedy, request_id="same")
    outputs = []
    while llm.has_unfinished_requests():
        outputs += llm.step()
    assert [o.request_id for o in outputs] == ["same"]
    assert outputs[0].outputs[0].token_ids == expected


def test_n_sequences_and_finish_reasons(llm: LLM) -> None:
    out = llm.generate([PROMPT], SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=5))[0]
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert all(c.finish_reason in ("stop", "length") for c in out.outputs)
    assert all(len(c.token_ids) <= 5 for c in out.outputs)
    # Sequence i samples with seed + i: each equals a lone request with that seed, and (fixed
    # model, fixed seeds) the three differ, so n > 1 is n samples, not one sample n times.
    singles = [
        llm.generate([PROMPT], SamplingParams(temperature=1.0, seed=3 + i, max_tokens=5))[0]
        .outputs[0]
        .token_ids
        for i in range(3)
    ]
    assert [c.token_ids for c in out.outputs] == singles
    assert len({tuple(s) for s in singles}) == 3
    capped = llm.generate([PROMPT], SamplingParams(max_tokens=4, ignore_eos=True))[0].outputs[0]
    assert capped.finish_reason == "length" and len(capped.token_ids) == 4


def test_seeded_request_is_independent_of_batch_neighbours(llm: LLM) -> None:
    seeded = SamplingParams(temperature=1.0, seed=1234, max_tokens=8, ignore_eos=True)
    alone = llm.generate([PROMPT], seeded)[0].outputs[0].token_ids
    others = [{"prompt_token_ids": [20 + i] * (3 + i)} for i in range(4)]
    mixed = llm.generate(
        [*others[:2], PROMPT, *others[2:]],
        [SamplingParams(temperature=0.7, max_tokens=8)] * 2
        + [seeded]
        + [SamplingParams(temperature=1.3, max_tokens=8)] * 2,
    )
    assert mixed[2].outputs[0].token_ids == alone


def test_stop_token_ids_and_logprobs(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = llm.generate([PROMPT], greedy)[0].outputs[0].token_ids
    stop_at = tokens[3]
    out = llm.generate(
        [PROMPT],
        SamplingParams(
            temperature=0, max_tokens=8, stop_token_ids=[stop_at], logprobs=2, ignore_eos=True
        ),
    )[0].outputs[0]
    first = tokens.index(stop_at)
    assert out.token_ids == tokens[: first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids)
    for token_id, entry in zip(out.token_ids, out.logprobs, strict=True):
        assert token_id in entry and entry[token_id].rank == 1  # greedy picks the top token


def test_min_tokens_suppresses_stop_token(llm: LLM) -> None:
    greedy = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    tokens = llm.generate([PROMPT], greedy)[0].outputs[0].token_ids
    out = llm.generate(
        [PROMPT],
        SamplingParams(
            temperature=0, max_tokens=8, stop_token_ids=[tokens[0]], min_tokens=4, ignore_eos=True
        ),
    )[0].outputs[0]
    assert len(out.token_ids) >= 4
    assert tokens[0] not in out.token_ids[:4]


def test_generate_is_all_or_nothing(tmp_path: Path) -> None:
    # 3 usable blocks of 16 tokens: a 100-token prompt passes validation (max_model_len 128)
    # but the core can never hold it, after the first prompt was already queued.
    small = LLM(str(make_tiny_model(tmp_path, "llama")), dtype="float32", max_model_len=128,
                num_kv_blocks=4)  # fmt: skip
    greedy = SamplingParams(temperature=0.0, max_tokens=3)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate([PROMPT, {"prompt_token_ids": list(range(3, 103))}], greedy)
    assert not small.has_unfinished_requests()
    outputs = small.generate([PROMPT], greedy)
    assert [len(o.outputs[0].token_ids) for o in outputs] == [3]
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate([{"prompt_token_ids": list(range(3, 103))}], SamplingParams(n=2))
    assert not small.has_unfinished_requests()
