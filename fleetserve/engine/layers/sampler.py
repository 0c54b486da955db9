"""The sampler: logits of the rows that sample this step → one token id per row (+ logprobs).

The sampler is stateless: everything per request arrives in a `SamplingMetadata` built each step by
`build_sampling_metadata` (the seeded generators are owned by the model runner and only advanced
here). The processing order is a contract (seed notes part 1 §2.22, part 2 §2.1); getting it wrong
does not crash, it is silently wrong:

1. snapshot the RAW logprobs (log_softmax of the float32 logits): these are what logprobs report;
2. cast to float32 (a copy: the caller's logits are never modified);
3. allowed-token mask → grammar bitmask (structured output) → logit_bias → min_tokens (block
   EOS / stop ids) → penalties;
4. greedy rows take the argmax of the processed logits; random rows go through temperature →
   min_p → top-k / top-p and are drawn with the exponential race `argmax(probs / q)`, q ~ Exp(1);
5. logprobs: the sampled token first, then the top-k of the raw distribution (or all of it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fleetserve.engine.core.outputs import LogprobsLists
from fleetserve.engine.sampling_params import SAMPLING_EPS, SamplingParams
from fleetserve.engine.structured_output.bitmask import apply_token_bitmask


@dataclass
class SamplingMetadata:
    """Per-step sampling state of the rows that sample (row i = the i-th sampling request)."""

    temperature: torch.Tensor  # [num_reqs] float32
    all_greedy: bool
    all_random: bool
    top_p: torch.Tensor | None  # [num_reqs] float32; None when no row uses top-p
    top_k: torch.Tensor | None  # [num_reqs] int64 (vocab_size where disabled); None when unused
    min_p: torch.Tensor | None  # [num_reqs] float32; None when unused
    generators: dict[int, torch.Generator]
    """Row index → that request's seeded generator (unseeded rows use the sampler's default)."""
    max_num_logprobs: int | None
    """None: no row wants logprobs; -1: the whole vocabulary; k >= 0: the top k."""
    no_penalties: bool
    presence_penalties: torch.Tensor  # [num_reqs] float32
    frequency_penalties: torch.Tensor  # [num_reqs] float32
    repetition_penalties: torch.Tensor  # [num_reqs] float32
    prompt_token_ids: torch.Tensor | None
    """[num_reqs, max_prompt_len] int64 padded with vocab_size; None when no row has penalties."""
    output_token_ids: list[list[int]]
    logit_bias: list[dict[int, float] | None]
    allowed_token_ids_mask: torch.Tensor | None  # [num_reqs, vocab_size] bool, True = NOT allowed
    min_tokens: dict[int, tuple[int, set[int]]]
    """Row → (min_tokens, ids blocked while fewer outputs exist: EOS + stop_token_ids)."""
    grammar_bitmask: torch.Tensor | None = None
    """[num_reqs, ceil(vocab / 32)] int32, bit set = allowed (all ones for unconstrained rows);
    None when no row is constrained (see `fleetserve.engine.structured_output`)."""


@dataclass
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [num_reqs] int64
    logprobs: LogprobsLists | None
    """One row per request: the sampled token first, then `max_num_logprobs` top tokens."""


def build_sampling_metadata(
    params: list[SamplingParams],
    prompt_token_ids: list[list[int]],
    output_token_ids: list[list[int]],
    generators: dict[int, torch.Generator],
    eos_token_ids: list[tuple[int, ...]],
    vocab_size: int,
    device: torch.device,
) -> SamplingMetadata:
    """Gather the per-request settings of this step's sampling rows into tensors.

    Args:
        params: one `SamplingParams` per row.
        prompt_token_ids / output_token_ids: each row's prompt and the tokens generated so far.
        generators: row → seeded generator, for rows whose request has a seed.
        eos_token_ids: each row's EOS ids (empty when the model has none).
        vocab_size: width of the logits.
        device: where the tensors live (the logits' device).

    Raises:
        ValueError: the per-row lists differ in length, or a logit_bias / allowed_token_ids
            token id lies outside [0, vocab_size).
    """
    num_reqs = len(params)
    lengths = {
        "prompt_token_ids": len(prompt_token_ids),
        "output_token_ids": len(output_token_ids),
        "eos_token_ids": len(eos_token_ids),
    }
    for name, length in lengths.items():
        if length != num_reqs:
            raise ValueError(f"{name} must have one entry per request ({num_reqs}), got {length}")

    def floats(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.float32, device=device)

    greedy = [p.is_greedy for p in params]
    use_top_k = any(0 < p.top_k < vocab_size for p in params)
    no_penalties = not any(_has_penalties(p) for p in params)
    return SamplingMetadata(
        temperature=floats([p.temperature for p in params]),
        all_greedy=all(greedy),
        all_random=not any(greedy),
        top_p=floats([p.top_p for p in params]) if any(p.top_p < 1.0 for p in params) else None,
        top_k=(
            torch.tensor(
                [p.top_k if 0 < p.top_k < vocab_size else vocab_size for p in params],
                dtype=torch.int64,
                device=device,
            )
            if use_top_k
            else None
        ),
        min_p=floats([p.min_p for p in params]) if any(p.min_p > 0.0 for p in params) else None,
        generators=generators,
        max_num_logprobs=_max_num_logprobs(params),
        no_penalties=no_penalties,
        presence_penalties=floats([p.presence_penalty for p in params]),
        frequency_penalties=floats([p.frequency_penalty for p in params]),
        repetition_penalties=floats([p.repetition_penalty for p in params]),
        prompt_token_ids=(
            None if no_penalties else _pad_token_ids(prompt_token_ids, vocab_size, device)
        ),
        output_token_ids=output_token_ids,
        logit_bias=[_checked_logit_bias(p, vocab_size) for p in params],
        allowed_token_ids_mask=_allowed_token_ids_mask(params, vocab_size, device),
        min_tokens=_min_tokens(params, eos_token_ids, vocab_size),
    )


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """The argmax of each row of `logits` [rows, vocab] (int64): the first of equal maxima, a NaN
    before any number, as `argmax` (checked in tests/engine/layers/test_sampler.py).

    float32 on the CPU goes through NumPy's `argmax`, which has the same rule, is vectorized,
    and runs on the calling thread: no OpenMP region, whose sleeping workers cost a step more
    than the search (on the Intel box 3.7 µs for 64 rows of 512 where torch's `max` takes 13.1,
    261-274 µs for 32 rows of 49,152 against 415-424, 3.1 µs for one row against 21.5). Elsewhere
    `max(dim=-1).indices`, which torch vectorizes (`argmax` took 1.06 ms where it took 0.44)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.max(dim=-1).indices


def samples_by_argmax(params: SamplingParams) -> bool:
    """Whether the sampler's token for a request is exactly the argmax of its raw logits, so
    that a step whose rows all are may skip `build_sampling_metadata` and the sampler: greedy,
    with no logprobs, no structured output, and nothing of step 3 that edits the logits
    (allowed ids, logit_bias, min_tokens, penalties)."""
    return (
        params.is_greedy
        and params.logprobs is None
        and params.structured_outputs is None
        and not params.allowed_token_ids
        and not params.logit_bias
        and params.min_tokens <= 0
        and not _has_penalties(params)
    )


def _has_penalties(params: SamplingParams) -> bool:
    """Whether any of the presence, frequency or repetition penalties is set."""
    return (
        params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
    )


def _max_num_logprobs(params: list[SamplingParams]) -> int | None:
    wanted = [p.logprobs for p in params if p.logprobs is not None]
    if not wanted:
        return None
    return -1 if -1 in wanted else max(wanted)


def _checked_logit_bias(params: SamplingParams, vocab_size: int) -> dict[int, float] | None:
    bias = params.logit_bias
    if bias and not all(0 <= token_id < vocab_size for token_id in bias):
        raise ValueError(f"logit_bias token ids must be in [0, {vocab_size}), got {sorted(bias)}")
    return bias


def _allowed_token_ids_mask(
    params: list[SamplingParams], vocab_size: int, device: torch.device
) -> torch.Tensor | None:
    if not any(p.allowed_token_ids for p in params):
        return None
    mask = torch.zeros(len(params), vocab_size, dtype=torch.bool, device=device)
    for row, p in enumerate(params):
        allowed = p.allowed_token_ids
        if not allowed:
            continue
        if not all(0 <= token_id < vocab_size for token_id in allowed):
            raise ValueError(
                f"allowed_token_ids must be in [0, {vocab_size}), got {sorted(allowed)}"
            )
        mask[row] = True
        mask[row, torch.tensor(allowed, dtype=torch.int64, device=device)] = False
    return mask


def _min_tokens(
    params: list[SamplingParams], eos_token_ids: list[tuple[int, ...]], vocab_size: int
) -> dict[int, tuple[int, set[int]]]:
    result: dict[int, tuple[int, set[int]]] = {}
    for row, (p, eos) in enumerate(zip(params, eos_token_ids, strict=True)):
        if p.min_tokens <= 0:
            continue
        # NOTE: with ignore_eos the EOS token does not end the request, so it is not blocked.
        blocked = set(p.stop_token_ids)
        if not p.ignore_eos:
            blocked.update(eos)
        blocked = {token_id for token_id in blocked if token_id < vocab_size}
        if blocked:
            result[row] = (p.min_tokens, blocked)
    return result


def _pad_token_ids(rows: list[list[int]], pad_id: int, device: torch.device) -> torch.Tensor:
    """[len(rows), longest row] int64, short rows padded with `pad_id` (one past the vocab)."""
    width = max((len(row) for row in rows), default=0)
    padded = [row + [pad_id] * (width - len(row)) for row in rows]
    return torch.tensor(padded, dtype=torch.int64, device=device).reshape(len(rows), width)


def _token_counts(token_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[num_reqs, vocab_size] occurrence counts of `token_ids` (padding id vocab_size dropped)."""
    counts = torch.zeros(
        token_ids.shape[0], vocab_size + 1, dtype=torch.float32, device=token_ids.device
    )
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


class Sampler(torch.nn.Module):
    """Stateless sampler; `default_generator` draws the unseeded random rows (None: torch's)."""

    def __init__(self, default_generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.default_generator = default_generator

    def forward(self, logits: torch.Tensor, metadata: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of `logits` ([num_reqs, vocab_size], any float dtype)."""
        raw_logprobs = None
        if metadata.max_num_logprobs is not None:
            # NOTE: logprobs follow the model's distribution, before any processing (seed).
            raw_logprobs = torch.log_softmax(logits.to(torch.float32), dim=-1)
        processed = self.apply_logits_processors(logits, metadata)
        sampled = self.sample(processed, metadata)
        logprobs = None
        if raw_logprobs is not None:
            assert metadata.max_num_logprobs is not None, "logprobs snapshot without a request"
            logprobs = gather_logprobs(raw_logprobs, sampled, metadata.max_num_logprobs)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def apply_logits_processors(
        self, logits: torch.Tensor, metadata: SamplingMetadata
    ) -> torch.Tensor:
        """Steps 2–3: a float32 copy with allowed mask, logit_bias, min_tokens and penalties."""
        logits = logits.to(dtype=torch.float32, copy=True)
        if metadata.allowed_token_ids_mask is not None:
            logits.masked_fill_(metadata.allowed_token_ids_mask, float("-inf"))
        if metadata.grammar_bitmask is not None:
            apply_token_bitmask(logits, metadata.grammar_bitmask)
        _apply_logit_bias(logits, metadata.logit_bias)
        _apply_min_tokens(logits, metadata)
        if not metadata.no_penalties:
            logits = _apply_penalties(logits, metadata)
        return logits

    def sample(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Step 4 on processed logits: argmax for greedy rows, the exponential race otherwise."""
        if metadata.all_greedy:
            return greedy_tokens(logits)
        greedy = None if metadata.all_random else greedy_tokens(logits)
        probs = self.compute_probs(logits, metadata)
        random = self._exponential_race(probs, metadata.generators)
        if greedy is None:
            return random
        return torch.where(metadata.temperature < SAMPLING_EPS, greedy, random)

    def compute_probs(self, logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
        """Sampling distribution of processed logits: temperature → min_p → top-k / top-p.

        Greedy rows use temperature 1 here (their sample is replaced by the argmax).
        """
        # NOTE: rows below SAMPLING_EPS would divide by ~0 (inf/NaN); they are greedy anyway.
        temperature = torch.where(
            metadata.temperature < SAMPLING_EPS,
            torch.ones_like(metadata.temperature),
            metadata.temperature,
        )
        logits = logits / temperature.unsqueeze(1)
        if metadata.min_p is not None:
            logits = _apply_min_p(logits, metadata.min_p)
        if metadata.top_k is not None or metadata.top_p is not None:
            logits = _apply_top_k_top_p(logits, metadata.top_k, metadata.top_p)
        return logits.softmax(dim=-1)

    def sample_from_probs(
        self, probs: torch.Tensor, generators: dict[int, torch.Generator]
    ) -> torch.Tensor:
        """One categorical draw per row of `probs` [rows, vocab] (speculative decoding draws
        its recovered and bonus tokens with the same exact method and generators)."""
        return self._exponential_race(probs, generators)

    def _exponential_race(
        self, probs: torch.Tensor, generators: dict[int, torch.Generator]
    ) -> torch.Tensor:
        """argmax(probs / q), q ~ Exp(1): an exact categorical draw without a CDF search."""
        num_reqs, vocab_size = probs.shape
        unseeded = [row for row in range(num_reqs) if row not in generators]
        if len(unseeded) == num_reqs:
            q = _exponential(num_reqs, vocab_size, self.default_generator, probs.device)
        else:
            q = torch.empty_like(probs)
            if unseeded:
                rows = torch.tensor(unseeded, dtype=torch.int64, device=probs.device)
                q[rows] = _exponential(
                    len(unseeded), vocab_size, self.default_generator, probs.device
                )
            # NOTE: a seeded row draws its whole row from its own generator, so its tokens do
            # not depend on its neighbours or its position in the batch.
            for row, generator in generators.items():
                assert 0 <= row < num_reqs, f"generator for row {row} of a {num_reqs}-row batch"
                q[row] = _exponential(1, vocab_size, generator, probs.device)[0]
        # NOTE: an Exp(1) draw can round to 0; 0/0 would be NaN, which argmax prefers.
        q.clamp_min_(torch.finfo(q.dtype).tiny)
        return probs.div(q).argmax(dim=-1)


def _exponential(
    num_rows: int, vocab_size: int, generator: torch.Generator | None, device: torch.device
) -> torch.Tensor:
    """[num_rows, vocab_size] float32 Exp(1) draws, made on the generator's own device."""
    draw_device = device if generator is None else generator.device
    q = torch.empty(num_rows, vocab_size, dtype=torch.float32, device=draw_device)
    return q.exponential_(generator=generator).to(device)


def _apply_logit_bias(logits: torch.Tensor, logit_bias: list[dict[int, float] | None]) -> None:
    rows: list[int] = []
    token_ids: list[int] = []
    values: list[float] = []
    for row, bias in enumerate(logit_bias):
        if not bias:
            continue
        rows.extend([row] * len(bias))
        token_ids.extend(bias.keys())
        values.extend(bias.values())
    if not rows:
        return
    device = logits.device
    logits.index_put_(
        (torch.tensor(rows, device=device), torch.tensor(token_ids, device=device)),
        torch.tensor(values, dtype=logits.dtype, device=device),
        accumulate=True,
    )


def _apply_min_tokens(logits: torch.Tensor, metadata: SamplingMetadata) -> None:
    rows: list[int] = []
    token_ids: list[int] = []
    for row, (min_tokens, blocked) in metadata.min_tokens.items():
        if len(metadata.output_token_ids[row]) < min_tokens:
            rows.extend([row] * len(blocked))
            token_ids.extend(blocked)
    if rows:
        device = logits.device
        logits[torch.tensor(rows, device=device), torch.tensor(token_ids, device=device)] = float(
            "-inf"
        )


def _apply_penalties(logits: torch.Tensor, metadata: SamplingMetadata) -> torch.Tensor:
    """Repetition (prompt + output, HF-style), then frequency and presence (output, OpenAI)."""
    assert metadata.prompt_token_ids is not None, "penalties need the padded prompt_token_ids"
    vocab_size = logits.shape[1]
    output_ids = _pad_token_ids(metadata.output_token_ids, vocab_size, logits.device)
    output_counts = _token_counts(output_ids, vocab_size)
    seen = (_token_counts(metadata.prompt_token_ids, vocab_size) > 0) | (output_counts > 0)
    repetition = metadata.repetition_penalties.unsqueeze(1)
    penalized = torch.where(logits > 0, logits / repetition, logits * repetition)
    logits = torch.where(seen, penalized, logits)
    logits = logits - metadata.frequency_penalties.unsqueeze(1) * output_counts
    logits = logits - metadata.presence_penalties.unsqueeze(1) * (output_counts > 0).float()
    # NOTE: an extreme (valid) penalty, e.g. repetition_penalty=5e-324, overflows positive
    # logits to +inf; two of them make the softmax NaN and the draw lands anywhere, even on a
    # token the grammar masked (the HTTP fuzzer found it). Overflow becomes the largest float,
    # NaN a masked token; a masked -inf stays -inf.
    return torch.nan_to_num(
        logits, nan=float("-inf"), posinf=torch.finfo(logits.dtype).max, neginf=float("-inf")
    )


def _apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Drop tokens whose probability is below min_p × the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _apply_top_k_top_p(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None
) -> torch.Tensor:
    """Keep each row's k best tokens, then the smallest set whose mass reaches top_p."""
    sorted_logits, sorted_ids = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        ranks = torch.arange(logits.shape[1], device=logits.device)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k.unsqueeze(1), float("-inf"))
    if top_p is not None:
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # NOTE: rows with top_p == 1 are left alone: float error can push the mass past 1.
        drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, sorted_ids, sorted_logits)


def gather_logprobs(
    raw_logprobs: torch.Tensor, sampled: torch.Tensor, num_logprobs: int
) -> LogprobsLists:
    """Per row: the given token first (`sampled` [rows], e.g. the sampled one), with its rank,
    then the top `num_logprobs` (-1: every token id in order)."""
    num_reqs, vocab_size = raw_logprobs.shape
    sampled = sampled.unsqueeze(1)
    sampled_logprobs = raw_logprobs.gather(1, sampled)
    ranks = (raw_logprobs > sampled_logprobs).sum(dim=-1) + 1
    if num_logprobs == -1:
        top_ids = torch.arange(vocab_size, device=raw_logprobs.device).expand(num_reqs, -1)
        top_logprobs = raw_logprobs
    else:
        top_logprobs, top_ids = raw_logprobs.topk(num_logprobs, dim=-1)
    token_ids = torch.cat([sampled, top_ids], dim=1)
    logprobs = torch.cat([sampled_logprobs, top_logprobs], dim=1)
    return LogprobsLists(
        logprob_token_ids=token_ids.tolist(),
        logprobs=logprobs.tolist(),
        sampled_token_ranks=ranks.tolist(),
    )
