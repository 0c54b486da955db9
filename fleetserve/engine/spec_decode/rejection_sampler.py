"""Rejection sampling of drafts: the target's output distribution, exactly.

Rows: request i occupies `n_i + 1` consecutive rows of the target's logits: row j < n_i scores
draft j (given the drafts before it), row n_i is the "bonus" position after the last draft.

- Greedy rows: draft j is accepted iff it is the target's argmax; the first rejected row (or the
  bonus row) contributes the argmax. The output equals plain greedy decoding token for token.
- Random rows (the standard speculative sampling rule): draft j with draft probability q_j(d) is
  accepted with probability min(1, p_j(d) / q_j(d)); at the first rejection the token is drawn
  from norm(max(0, p_j - q_j)); when all are accepted the bonus token is drawn from p_{n_i}.
  For drafts without probabilities (n-gram lookup) q_j is one-hot at d, so acceptance is p_j(d)
  and the recovered distribution is p_j with d removed.

Every draw uses the request's seeded generator when it has one (the sampler's default otherwise),
so a seeded request's tokens do not depend on its batch neighbours.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fleetserve.engine.layers.sampler import Sampler, SamplingMetadata
from fleetserve.engine.sampling_params import SAMPLING_EPS


@dataclass
class DraftRows:
    """The drafts of one step, in the row layout above."""

    num_draft_tokens: list[int]
    """n_i per request (0: a plain sample from one row)."""
    draft_token_ids: list[int]
    """All drafts back to back (sum of n_i)."""
    draft_probs: torch.Tensor | None = None
    """[sum n_i, vocab] the distributions the drafts were drawn from; None: one-hot drafts."""

    def __post_init__(self) -> None:
        total = sum(self.num_draft_tokens)
        if len(self.draft_token_ids) != total:
            raise ValueError(
                f"draft_token_ids must hold sum(num_draft_tokens) = {total} ids, "
                f"got {len(self.draft_token_ids)}"
            )
        if self.draft_probs is not None and self.draft_probs.shape[0] != total:
            raise ValueError(
                f"draft_probs must have one row per draft ({total}), "
                f"got {self.draft_probs.shape[0]}"
            )

    @property
    def num_rows(self) -> int:
        return sum(self.num_draft_tokens) + len(self.num_draft_tokens)


@dataclass
class RejectionOutput:
    token_ids: list[list[int]]
    """Per request: its accepted drafts followed by one token of the target's (1..n_i+1)."""
    row_token_ids: torch.Tensor
    """[num_rows] the token each row stands for (the draft where accepted, else the target's
    draw); rows past a request's output are meaningless. Used to gather logprobs."""


class RejectionSampler:
    """Verifies drafts against the target's processed logits (see module doc)."""

    def __init__(self, sampler: Sampler) -> None:
        self.sampler = sampler

    def __call__(
        self, logits: torch.Tensor, metadata: SamplingMetadata, drafts: DraftRows
    ) -> RejectionOutput:
        """Verify `drafts` against `logits`.

        Args:
            logits: [num_rows, vocab] processed logits (logit_bias, penalties, ... applied per
                row, each row seeing the drafts before it as outputs).
            metadata: per row (a request's settings repeated over its rows).
            drafts: the drafts and their layout.
        """
        num_rows = logits.shape[0]
        if num_rows != drafts.num_rows:
            raise ValueError(f"logits must have {drafts.num_rows} rows, got {num_rows}")
        device = logits.device
        layout = _RowLayout(drafts.num_draft_tokens, device)
        draft_ids = torch.tensor(drafts.draft_token_ids, dtype=torch.int64, device=device)
        target_argmax = logits.argmax(dim=-1)
        greedy_rows = metadata.temperature < SAMPLING_EPS
        accepted = draft_ids == target_argmax[layout.draft_rows]
        row_tokens = target_argmax
        if not metadata.all_greedy:
            probs = self.sampler.compute_probs(logits, metadata)
            draws_probs = probs.clone()
            if draft_ids.numel():
                draws_probs[layout.draft_rows], accepted_random = self._verify_random(
                    probs[layout.draft_rows], draft_ids, drafts.draft_probs, metadata, layout
                )
                accepted = torch.where(greedy_rows[layout.draft_rows], accepted, accepted_random)
            random_tokens = self.sampler.sample_from_probs(draws_probs, metadata.generators)
            row_tokens = torch.where(greedy_rows, target_argmax, random_tokens)
        row_tokens = row_tokens.clone()
        row_tokens[layout.draft_rows] = torch.where(
            accepted, draft_ids, row_tokens[layout.draft_rows]
        )
        return RejectionOutput(
            token_ids=_accepted_prefixes(
                accepted.tolist(), row_tokens.tolist(), drafts.num_draft_tokens
            ),
            row_token_ids=row_tokens,
        )

    def _verify_random(
        self,
        target: torch.Tensor,
        draft_ids: torch.Tensor,
        draft_probs: torch.Tensor | None,
        metadata: SamplingMetadata,
        layout: _RowLayout,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(recovered distributions, accepted) for the draft rows."""
        picked = draft_ids.unsqueeze(1)
        p = target.gather(1, picked).squeeze(1)
        if draft_probs is None:
            q = torch.ones_like(p)
            residual = target.scatter(1, picked, 0.0)
        else:
            q = draft_probs.gather(1, picked).squeeze(1)
            residual = (target - draft_probs).clamp_min_(0.0)
        uniform = _uniforms(layout, metadata.generators, self.sampler.default_generator, p.device)
        # NOTE: u < min(1, p/q) without the division: float rounding must not divide by 0.
        accepted = uniform * q < p
        mass = residual.sum(dim=-1, keepdim=True)
        # NOTE: no residual mass means p <= q everywhere, i.e. p == q: the draft is always
        # accepted and the recovered row never used; it stays a valid distribution anyway.
        recovered = torch.where(mass > 0, residual / mass.clamp_min(1e-30), target)
        return recovered, accepted


class _RowLayout:
    """Row indices of the drafts, grouped per request (request i's rows are contiguous)."""

    def __init__(self, num_draft_tokens: list[int], device: torch.device) -> None:
        starts: list[int] = []
        draft_rows: list[int] = []
        row = 0
        for n in num_draft_tokens:
            starts.append(row)
            draft_rows.extend(range(row, row + n))
            row += n + 1
        self.starts = starts
        self.num_draft_tokens = num_draft_tokens
        self.draft_rows = torch.tensor(draft_rows, dtype=torch.int64, device=device)


def _uniforms(
    layout: _RowLayout,
    generators: dict[int, torch.Generator],
    default: torch.Generator | None,
    device: torch.device,
) -> torch.Tensor:
    """One U[0, 1) per draft row; a request whose first row has a generator draws all of its
    own from it (rows of one request share one generator)."""
    num_unseeded = sum(
        n for start, n in zip(layout.starts, layout.num_draft_tokens, strict=True)
        if start not in generators
    )  # fmt: skip
    shared = _rand(num_unseeded, default, device)
    pieces: list[torch.Tensor] = []
    used = 0
    for start, n in zip(layout.starts, layout.num_draft_tokens, strict=True):
        if not n:
            continue
        if start in generators:
            pieces.append(_rand(n, generators[start], device))
        else:
            pieces.append(shared[used : used + n])
            used += n
    return torch.cat(pieces) if pieces else torch.empty(0, device=device)


def _rand(n: int, generator: torch.Generator | None, device: torch.device) -> torch.Tensor:
    draw_device = device if generator is None else generator.device
    return torch.rand(n, generator=generator, device=draw_device).to(device)


def _accepted_prefixes(
    accepted: list[bool], row_tokens: list[int], num_draft_tokens: list[int]
) -> list[list[int]]:
    """Per request: rows up to and including the first rejected one (or the bonus row)."""
    result: list[list[int]] = []
    row = draft = 0
    for n in num_draft_tokens:
        num_accepted = 0
        while num_accepted < n and accepted[draft + num_accepted]:
            num_accepted += 1
        result.append(row_tokens[row : row + num_accepted + 1])
        row += n + 1
        draft += n
    return result
