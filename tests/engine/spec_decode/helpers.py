"""Shared pieces of the speculative decoding tests: runs, and proposers with known answers."""

from __future__ import annotations

from typing import Any

import numpy as np

from fleetserve import LLM, SamplingParams
from fleetserve.engine.core.engine_core import EngineCore
from fleetserve.engine.spec_decode.decoder import SpecDecoder


def generate_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def spec_decoder(core: EngineCore) -> SpecDecoder:
    """The runner's `SpecDecoder` of an in-process engine (one worker)."""
    executor: Any = core.executor  # the UniProcExecutor: one worker in this process
    spec = executor.worker.model_runner.spec
    assert spec is not None, "the engine has no speculative decoding"
    return spec


class OracleProposer:
    """Proposes each request's known continuation (from a plain run), corrupting the drafts at
    `wrong_positions` (all positions: every draft is rejected; none: every draft is accepted).

    Histories are matched by prefix against the reference sequences (prompt + outputs).
    """

    def __init__(
        self,
        references: list[list[int]],
        num_tokens: int,
        vocab_size: int,
        wrong_positions: set[int] | None = None,
    ) -> None:
        self.references = [np.array(r, dtype=np.int64) for r in references]
        self.num_tokens = num_tokens
        self.vocab_size = vocab_size
        self.wrong_positions = (
            set(range(num_tokens)) if wrong_positions is None else wrong_positions
        )
        self.num_calls = 0

    def propose(self, token_ids: np.ndarray, max_tokens: int | None = None) -> list[int]:
        self.num_calls += 1
        n = len(token_ids)
        k = self.num_tokens if max_tokens is None else min(max_tokens, self.num_tokens)
        for reference in self.references:
            if len(reference) > n and np.array_equal(reference[:n], token_ids):
                drafts = [int(t) for t in reference[n : n + k]]
                return [
                    (t + 1) % self.vocab_size if i in self.wrong_positions else t
                    for i, t in enumerate(drafts)
                ]
        # Past the reference (or an unknown history): a token the reference never has next.
        return [int(token_ids[-1] + 1) % self.vocab_size] * k
