"""Speculative decoding under a grammar (seed notes part 2 §2.2): drafts are cut to the longest
prefix the grammar accepts before they are scheduled, verification row j of a constrained
request is masked with its grammar after drafts 0..j-1, and the grammar advances by the
accepted tokens. Greedy outputs equal the run without speculation, every output follows its
constraint, and drafts are verified and accepted along the way (tiny model, n-gram proposer
over prompts whose letters the regex allows)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from fleetserve import LLM, SamplingParams
from fleetserve.engine.structured_output.params import StructuredOutputsParams
from tests.engine.tiny_models import make_tiny_model

REGEX = r"[a-d]{4,12}x"
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}  # fmt: skip


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("llama"), "llama")


def _prompts() -> list[str]:
    return [("abcd" * 12)[i:] + " " + ("dcba" * 3)[: 2 + i] for i in range(6)]


@pytest.mark.parametrize("setting", [{}, {"num_kv_blocks": 12, "block_size": 16, "max_num_batched_tokens": 64}],
                         ids=["defaults", "preempt"])  # fmt: skip
def test_greedy_constrained_outputs_are_unchanged_by_speculation(
    tiny_llama: Path, setting: dict
) -> None:
    regex = StructuredOutputsParams.create(regex=REGEX)
    choice = StructuredOutputsParams.create(choice=["abcabc", "dcbadcba", "ab"])
    params = [
        SamplingParams(temperature=0.0, max_tokens=16, structured_outputs=so)
        for so in [regex, choice, None, regex, choice, regex]
    ]
    runs = {}
    for name, spec in (("plain", None), ("ngram", SPEC)):
        llm = LLM(str(tiny_llama), dtype="float32", max_model_len=256,
                  speculative_config=spec, **setting)  # fmt: skip
        runs[name] = [o.outputs[0] for o in llm.generate(_prompts(), params)]
        if spec is not None:
            stats = llm.engine_core.make_stats().spec_decoding
            assert stats is not None and stats.num_draft_tokens > 0, "no draft was verified"
            assert stats.num_accepted_tokens > 0, "no draft was accepted"
        if "num_kv_blocks" in setting:
            assert llm.engine_core.make_stats().num_preemptions > 0
        del llm
    assert [o.token_ids for o in runs["ngram"]] == [o.token_ids for o in runs["plain"]]
    for output, p in zip(runs["ngram"], params, strict=True):
        if p.structured_outputs is regex:
            assert re.fullmatch(REGEX, output.text), output.text
        elif p.structured_outputs is choice:
            assert output.text in ["abcabc", "dcbadcba", "ab"], output.text
