"""`prompt_logprobs`: each prompt token's log-probability given the tokens before it.

Checked against transformers' log-softmax over the same prompt, under chunked prefill (a prompt
split across steps), preemption (a recomputed prompt must not report twice), n > 1 and a shared
prefix (a request that wants prompt logprobs never takes a prefix-cache hit).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fleetserve import LLM, SamplingParams
from fleetserve.engine.core.outputs import EngineCoreOutput, LogprobsLists
from fleetserve.engine.output_processor import OutputKind, OutputProcessor
from fleetserve.engine.tokenizer import load_tokenizer
from tests.engine.tiny_models import hf_model, make_prompts, make_tiny_model

K = 3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("prompt-logprobs"), "llama")


def _hf_prompt_logprobs(path: Path, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row p is the distribution of token p + 1."""
    with torch.inference_mode():
        logits = hf_model(str(path))(input_ids=torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)[:-1]


def _check(path: Path, prompt: list[int], got: list | None) -> None:
    assert got is not None and len(got) == len(prompt)
    assert got[0] is None
    reference = _hf_prompt_logprobs(path, prompt)
    for p, entry in enumerate(got[1:]):
        token = prompt[p + 1]
        assert entry is not None and token in entry
        assert entry[token].logprob == pytest.approx(reference[p, token].item(), abs=1e-4)
        assert entry[token].rank == int((reference[p] > reference[p, token]).sum()) + 1
        top = sorted((lp for tid, lp in entry.items() if lp.rank is not None and lp.rank <= K),
                     key=lambda lp: lp.rank or 0)  # fmt: skip
        assert [lp.logprob for lp in top][:K] == pytest.approx(
            reference[p].topk(K).values.tolist(), abs=1e-4
        )


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"max_num_batched_tokens": 16, "long_prefill_token_threshold": 8},  # chunked prompts
        {"num_kv_blocks": 12, "block_size": 16, "max_num_batched_tokens": 64},  # preemptions
    ],
    ids=["defaults", "chunked", "preempted"],
)
def test_prompt_logprobs_match_transformers(tiny: Path, settings: dict[str, int]) -> None:
    llm = LLM(str(tiny), dtype="float32", max_model_len=128, **settings)  # type: ignore[arg-type]
    prompts = make_prompts(512, [1, 9, 40, 23, 61, 90, 33, 47], seed=5)
    params = SamplingParams(temperature=0, max_tokens=16, prompt_logprobs=K, ignore_eos=True)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    for prompt, output in zip(prompts, outputs, strict=True):
        _check(tiny, prompt, output.prompt_logprobs)
    if "num_kv_blocks" in settings:
        assert llm.engine_core.scheduler.num_preemptions > 0


def test_n_and_a_shared_prefix_still_report_every_prompt_token(tiny: Path) -> None:
    llm = LLM(str(tiny), dtype="float32", max_model_len=128, block_size=4)
    shared = make_prompts(512, [24], seed=9)[0]
    plain = SamplingParams(temperature=0, max_tokens=2)
    assert llm.generate([{"prompt_token_ids": [*shared, 7]}], plain)[0].num_cached_tokens == 0
    again = llm.generate([{"prompt_token_ids": [*shared, 8]}], plain)[0]
    assert again.num_cached_tokens == 24  # the prefix is cached ...
    prompt = [*shared, 9]
    one = SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K)
    out = llm.generate([{"prompt_token_ids": prompt}], one)[0]
    assert out.num_cached_tokens == 0  # ... but a prompt-logprobs request computes it all
    _check(tiny, prompt, out.prompt_logprobs)
    # n > 1: the first sequence computes them for all (the others may hit the cache).
    many = SamplingParams(temperature=0.7, seed=1, n=3, max_tokens=2, prompt_logprobs=K)
    out = llm.generate([{"prompt_token_ids": [*shared, 10]}], many)[0]
    assert len(out.outputs) == 3
    _check(tiny, [*shared, 10], out.prompt_logprobs)


def test_a_stream_sends_prompt_logprobs_once(tiny: Path) -> None:
    processor = OutputProcessor(load_tokenizer(str(tiny)))
    params = SamplingParams(max_tokens=2, prompt_logprobs=0)
    processor.add_request("s", None, [5, 6, 7], params, OutputKind.DELTA)
    rows = LogprobsLists(
        logprob_token_ids=[[6, 6], [7, 7]], logprobs=[[-1.5, -1.5], [-0.5, -0.5]],
        sampled_token_ranks=[1, 1],
    )  # fmt: skip
    first = processor.process_outputs(
        [EngineCoreOutput(req_id="s", new_token_ids=[9], prompt_logprobs=rows)]
    ).request_outputs[0]
    assert first.prompt_logprobs is not None and first.prompt_logprobs[0] is None
    assert [list(e) for e in first.prompt_logprobs[1:] if e is not None] == [[6], [7]]
    assert first.prompt_logprobs[2][7].logprob == -0.5  # type: ignore[index]
    second = processor.process_outputs(
        [EngineCoreOutput(req_id="s", new_token_ids=[9], finish_reason="length")]
    ).request_outputs[0]
    assert second.prompt_logprobs is None


def test_bad_prompt_logprobs_are_refused() -> None:
    with pytest.raises(ValueError, match=r"prompt_logprobs must be None, -1 .* \[0, 20\]"):
        SamplingParams(prompt_logprobs=21)


def test_preemption_mid_prompt_reports_each_position_once(tiny: Path) -> None:
    """B's prompt is computed 4 tokens a step; A's decode then needs B's blocks: B (newest) is
    preempted mid-prompt, later recomputed from the start, and still reports each position once."""
    llm = LLM(
        str(tiny), dtype="float32", max_model_len=128, block_size=4, num_kv_blocks=15,
        long_prefill_token_threshold=4, max_num_batched_tokens=16,
    )  # fmt: skip
    a, b = make_prompts(512, [40, 40], seed=11)
    params = SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=K, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": a}, {"prompt_token_ids": b}], params)
    assert llm.engine_core.scheduler.num_preemptions > 0
    for prompt, out in zip((a, b), outs, strict=True):
        _check(tiny, prompt, out.prompt_logprobs)
