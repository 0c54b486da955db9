"""The seams structured output plugs into (its wiring lands with the merge):

- a scheduler-side draft filter keeps a prefix of each request's drafts (a grammar's longest
  valid prefix) before they are scheduled;
- a runner-side row hook edits the processed logits of every verification row (a grammar's
  bitmask after drafts 0..j-1) before the rejection sampler reads them.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from fleetserve import LLM, SamplingParams
from fleetserve.engine.request import Request
from fleetserve.engine.worker.input_batch import CachedRequestState
from tests.engine.spec_decode.helpers import OracleProposer, generate_ids, spec_decoder
from tests.engine.tiny_models import make_prompts

K = 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def _setup(model: Path) -> tuple[LLM, list[list[int]], list[list[int]]]:
    prompts = make_prompts(512, [5, 18, 30], seed=21)
    expected = generate_ids(LLM(str(model), dtype="float32", max_model_len=128), prompts, GREEDY)
    llm = LLM(
        str(model),
        dtype="float32",
        max_model_len=128,
        speculative_config={"method": "ngram", "num_speculative_tokens": K},
    )
    references = [p + e for p, e in zip(prompts, expected, strict=True)]
    spec_decoder(llm.engine_core).history_proposer = OracleProposer(
        references, K, 512, wrong_positions=set()
    )
    return llm, prompts, expected


def test_a_draft_filter_limits_what_is_verified(tiny_llama_dir: Path) -> None:
    llm, prompts, expected = _setup(tiny_llama_dir)
    seen: list[list[int]] = []

    def first_only(request: Request, drafts: list[int]) -> list[int]:
        seen.append(drafts)
        return drafts[:1]

    scheduling = llm.engine_core.scheduler.spec
    assert scheduling is not None
    scheduling.draft_filter = first_only
    assert generate_ids(llm, prompts, GREEDY) == expected
    stats = llm.engine_core.make_stats().spec_decoding
    assert stats is not None and seen and any(len(d) > 1 for d in seen)
    assert stats.num_draft_tokens == stats.num_drafts == stats.num_accepted_tokens


def test_a_row_hook_sees_every_verification_row(tiny_llama_dir: Path) -> None:
    llm, prompts, expected = _setup(tiny_llama_dir)
    shapes: list[tuple[int, int]] = []

    def ban_each_first_draft(
        logits: torch.Tensor, states: Sequence[CachedRequestState], drafts: Sequence[list[int]]
    ) -> None:
        assert logits.shape[0] == sum(len(d) + 1 for d in drafts)
        shapes.append((logits.shape[0], len(states)))
        row = 0
        for request_drafts in drafts:
            if request_drafts:
                logits[row, request_drafts[0]] = float("-inf")
            row += len(request_drafts) + 1

    spec_decoder(llm.engine_core).row_logits_hook = ban_each_first_draft
    outputs = generate_ids(llm, prompts, GREEDY)
    assert shapes, "the hook never ran"
    # Every first draft is the right token, and the hook forbids it: none can be accepted, and
    # the outputs leave the plain run's path.
    stats = llm.engine_core.make_stats().spec_decoding
    assert stats is not None and stats.num_draft_tokens > 0 and stats.num_accepted_tokens == 0
    assert outputs != expected
