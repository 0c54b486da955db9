"""Seeded random sampling keeps its distribution under speculative decoding (end to end).

A one-layer tiny model samples 4 tokens at temperature 1 from a repeating prompt, its vocabulary
cut to 8 tokens (`allowed_token_ids`) so that 1000 seeded requests estimate each position's
distribution. The n-gram proposer drafts on every step (the prompt repeats); a draft model
(another random model) drafts from its own distribution. The per-position token frequencies with
speculation must match those without (total variation below 0.15; two plain runs with different
seeds differ by about 0.05); the same check with the acceptance rule broken (every draft
accepted) fails (about 0.6 with n-gram drafts).

NOTE: verification steps take the torch attention backend's per-request multi-token path on the
CPU, which is slow; the draft-model variant (twice the multi-token passes) is marked slow.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from fleetserve import LLM, SamplingParams
from fleetserve.engine.spec_decode.rejection_sampler import RejectionSampler
from tests.engine.tiny_models import make_tiny_model

ALLOWED = [10, 11, 12, 13, 14, 15, 16, 17]
PROMPT = [10, 11, 12, 13, 14, 15] * 4
NUM_REQUESTS = 1000
NUM_TOKENS = 4
TV_THRESHOLD = 0.15
METHODS = ["ngram", pytest.param("draft_model", marks=pytest.mark.slow)]


def _frequencies(
    model: Path, speculative: dict[str, Any] | None, seed_base: int, check_stats: bool = True
) -> torch.Tensor:
    """[NUM_TOKENS, len(ALLOWED)] token frequencies per output position."""
    llm = LLM(str(model), dtype="float32", max_model_len=64, speculative_config=speculative)
    params = [
        SamplingParams(
            temperature=1.0, max_tokens=NUM_TOKENS, ignore_eos=True, seed=seed_base + i,
            allowed_token_ids=ALLOWED,
        )
        for i in range(NUM_REQUESTS)
    ]  # fmt: skip
    outs = llm.generate([{"prompt_token_ids": PROMPT}] * NUM_REQUESTS, params)
    tokens = torch.tensor([o.outputs[0].token_ids for o in outs])
    counts = torch.stack(
        [
            torch.bincount(tokens[:, j] - ALLOWED[0], minlength=len(ALLOWED))
            for j in range(NUM_TOKENS)
        ]
    )
    if speculative is not None and check_stats:
        stats = llm.engine_core.make_stats().spec_decoding
        assert stats is not None and stats.num_draft_tokens > NUM_REQUESTS, stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens, stats
    return counts.to(torch.float64) / NUM_REQUESTS


def _worst_tv(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(0.5 * (a - b).abs().sum(dim=1).max())


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, torch.Tensor]:
    root = tmp_path_factory.mktemp("dist")
    target = make_tiny_model(root, "llama", seed=0, num_hidden_layers=1)
    draft = make_tiny_model(root, "llama", seed=3, num_hidden_layers=1)
    return target, draft, _frequencies(target, None, seed_base=0)


def _spec(method: str, draft: Path) -> dict[str, Any]:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3}
    return {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}


@pytest.mark.parametrize("method", METHODS)
def test_speculation_keeps_the_sampling_distribution(models: Any, method: str) -> None:
    target, draft, plain = models
    # Other seeds than the plain run's: the samples are independent, only the law is shared.
    speculative = _frequencies(target, _spec(method, draft), seed_base=10 * NUM_REQUESTS)
    assert _worst_tv(plain, speculative) < TV_THRESHOLD


@pytest.mark.parametrize("method", METHODS)
def test_a_broken_acceptance_rule_fails_the_same_check(
    models: Any, method: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    target, draft, plain = models
    verify = RejectionSampler._verify_random

    def accept_everything(self, *args):  # type: ignore[no-untyped-def]
        recovered, accepted = verify(self, *args)
        return recovered, torch.ones_like(accepted)

    monkeypatch.setattr(RejectionSampler, "_verify_random", accept_everything)
    speculative = _frequencies(target, _spec(method, draft), 20 * NUM_REQUESTS, False)
    assert _worst_tv(plain, speculative) > TV_THRESHOLD
