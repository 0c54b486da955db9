"""The routing policy: which decode engine serves a request, and whether a prefill engine runs
its prompt first. Pure: no HTTP, no asyncio, no clock; the caller passes snapshots of the fleet.

Decode first. Candidates are the available decode and unified engines not excluded for this
request; an engine whose queue or KV cache is full (`EngineLoad.saturated`) is skipped while
another is not. Each candidate is scored

    score = prefix_fraction                                  (prefix-aware)
            - RELATIVE_LOAD_WEIGHT * relative_load - LOAD_WEIGHT * load   (load-aware)

where `prefix_fraction` is the share of the prompt's full blocks the engine is believed to hold
(the longest run of its block hashes in the router's `ApproxPrefixCache`), `load` in [0, 2]
combines the engine's queue (waiting / saturation), its running batch and KV usage, and
`relative_load` is that load min-max normalised over the candidates (0 for the least loaded, 1
for the most; the spread counts as at least `MIN_LOAD_SPREAD`), as llm-d's queue scorer does.
The relative term is what spreads traffic: a prompt that shares only a system prompt with
earlier ones (half its blocks) goes to a less loaded engine, such as a decode pod just scaled
out, rather than pile onto the engine that saw the system prompt first; a hit of more than 3/4
of the prompt keeps its engine against a small load difference, and the absolute term stops
that once the hit engine is heavily loaded. Equally loaded engines are chosen by prefix alone; scores within
`SCORE_TOLERANCE` of the best are ties, and ties go round-robin.

Then prefill: a unified engine never uses one (`colocated`). Otherwise the mode decides:
`never` is decode-only; `always` takes the least loaded available prefill engine whose
compatibility hash equals the decode engine's (and whose pair breaker is closed); `selective`
does so only when at least `min_uncached_tokens` prompt tokens are not already cached on the
chosen decode engine. With no usable prefill engine (none compatible, all broken or saturated)
the request is decode-only: the decode engine computes the whole prompt.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Literal

from fleetserve.common.block_hash import BlockHash
from fleetserve.router.prefix_cache import ApproxPrefixCache

__all__ = [
    "DECODE_ROLES",
    "Decision",
    "DecisionKind",
    "EngineLoad",
    "EngineSnapshot",
    "NoEngineAvailable",
    "Role",
    "RoutingPolicy",
    "RoutingRequest",
]

Role = Literal["prefill", "decode", "unified"]
DECODE_ROLES: tuple[Role, ...] = ("decode", "unified")
"""The roles that can take a request's decode (the policy's decode candidates)."""
DecisionKind = Literal["disaggregated", "decode_only", "colocated"]

LOAD_WEIGHT = 0.5
"""How much one unit of absolute load costs against a full prefix hit (module docstring)."""
RELATIVE_LOAD_WEIGHT = 0.75
"""How much being the most loaded candidate costs against a full prefix hit."""
MIN_LOAD_SPREAD = 0.05
"""The load spread that counts as a full one for `relative_load` (about one request's worth:
one running request is 1/9 * 0.5 = 0.056): below it, differences are scaled down rather than
stretched to 0..1, so two KV blocks still held on an idle engine do not read as "most loaded"."""
SCORE_TOLERANCE = 0.02
"""Scores this close to the best are ties (round-robin among them): load is measured with noise
and lags, and a deterministic preference on noise starves an engine (e.g. one just recovered
from a stall, still holding a transfer's blocks, would never get its half-open trial)."""
KV_SATURATED = 0.98
"""KV usage at or above which an engine is saturated (it would preempt or queue)."""


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """An engine's scheduler load as last scraped from its /metrics."""

    waiting: float = 0.0
    running: float = 0.0
    kv_usage: float = 0.0


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What the policy knows about one engine at decision time."""

    url: str
    role: Role
    compatibility_hash: str | None
    """Its KV compatibility hash (None: unknown or no connector; never paired)."""
    load: EngineLoad = field(default_factory=EngineLoad)
    available: bool = True
    """Discovered ready and its breaker allows a request."""
    in_flight: int = 0
    """Requests the router has on it now (fresher than the scraped load)."""
    adapters: frozenset[str] = frozenset()
    """The LoRA adapters its /v1/models lists (the models with a `parent`)."""


@dataclass(frozen=True, slots=True)
class RoutingRequest:
    """The request as the policy sees it (hashes from `fleetserve.common.block_hash`)."""

    block_hashes: Sequence[BlockHash] = ()
    num_prompt_tokens: int | None = None
    """None when the prompt was not tokenized (selective mode then prefills remotely)."""
    disaggregable: bool = True
    """False for requests the P/D protocol cannot carry (a batch of prompts)."""
    exclude_decode: Collection[str] = ()
    exclude_prefill: Collection[str] = ()
    exclude_pairs: Collection[tuple[str, str]] = ()
    """(prefill, decode) pairs that failed for this request already."""
    adapter: str | None = None
    """The LoRA adapter the request's `model` names (None: the base model)."""


@dataclass(frozen=True, slots=True)
class Decision:
    """Where one request goes. `reason` is a short metric label value."""

    decode_url: str
    prefill_url: str | None
    kind: DecisionKind
    reason: str
    cached_tokens: int = 0
    """Prompt tokens believed cached on the decode engine."""


class NoEngineAvailable(Exception):
    """No decode or unified engine can take the request; `saturated` when some exist but all
    are saturated (the client should retry later: 429) rather than down (503)."""

    def __init__(self, message: str, *, saturated: bool) -> None:
        super().__init__(message)
        self.saturated = saturated


def with_adapter(engines: list[EngineSnapshot], adapter: str | None) -> list[EngineSnapshot]:
    """The engines that serve `adapter` (all of them for the base model, or when none lists it).

    Adapter affinity is a filter, not a preference: an engine that does not list the adapter
    answers its requests with a 400 (it does not load adapters on its own). Among those that
    do, the usual prefix-and-load score applies, and since an adapter's block hashes carry its
    name, its repeated prompts gather where its KV blocks (and its device slot) already are.
    When no engine lists it, every engine stays a candidate, so the client gets the engine's
    own 400 naming what it serves.
    """
    if adapter is None:
        return engines
    serving = [e for e in engines if adapter in e.adapters]
    return serving or engines


class RoutingPolicy:
    """Pure routing decisions; holds only its settings and a round-robin counter."""

    def __init__(
        self,
        *,
        mode: Literal["always", "selective", "never"],
        min_uncached_tokens: int,
        block_size: int,
        prefix_aware: bool = True,
        load_aware: bool = True,
        saturation_waiting: int = 32,
    ) -> None:
        if mode not in ("always", "selective", "never"):
            raise ValueError(f"mode must be always, selective or never, got {mode!r}")
        if min_uncached_tokens < 0:
            raise ValueError(f"min_uncached_tokens must be >= 0, got {min_uncached_tokens}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.mode = mode
        self.min_uncached_tokens = min_uncached_tokens
        self.block_size = block_size
        self.prefix_aware = prefix_aware
        self.load_aware = load_aware
        self.saturation_waiting = saturation_waiting
        self._turn = 0

    @property
    def needs_tokens(self) -> bool:
        """Whether decisions use the prompt's tokens (else the caller may skip tokenizing)."""
        return self.prefix_aware or self.mode == "selective"

    def saturated(self, engine: EngineSnapshot) -> bool:
        """The engine's own queue at the saturation limit, or its KV cache full.

        Only what the engine reported counts here: the router's in-flight count says nothing of
        how many the engine runs at once, so a burst to an idle engine between two scrapes
        (all of it "in flight", none of it seen running yet) would read as a queue and be
        refused with 429s the engine would have served. In-flight requests weigh in the score.
        """
        load = engine.load
        return (self.saturation_waiting > 0 and load.waiting >= self.saturation_waiting) or (
            load.kv_usage >= KV_SATURATED
        )

    def decide(
        self,
        engines: Sequence[EngineSnapshot],
        request: RoutingRequest,
        prefixes: ApproxPrefixCache,
    ) -> Decision:
        """Pick the decode engine, then whether and where to prefill remotely.

        Raises:
            NoEngineAvailable: no decode or unified engine is available for the request.
        """
        self._turn += 1
        candidates = [
            e for e in engines if e.role in DECODE_ROLES and e.url not in request.exclude_decode
        ]
        usable = with_adapter([e for e in candidates if e.available], request.adapter)
        if not usable:
            raise NoEngineAvailable(
                "no decode engine is available"
                + (" (all are down or ejected)" if candidates else " (none discovered)"),
                saturated=False,
            )
        unsaturated = [e for e in usable if not self.saturated(e)]
        if not unsaturated:
            raise NoEngineAvailable("every decode engine is saturated", saturated=True)
        decode, matched = self._best(unsaturated, request.block_hashes, prefixes)
        cached = matched * self.block_size
        if decode.role == "unified":
            return Decision(decode.url, None, "colocated", "unified", cached)
        if self.mode == "never":
            return Decision(decode.url, None, "decode_only", "mode_never", cached)
        if not request.disaggregable:
            return Decision(decode.url, None, "decode_only", "batch", cached)
        if self.mode == "selective" and request.num_prompt_tokens is not None:
            uncached = request.num_prompt_tokens - cached
            if uncached < self.min_uncached_tokens:
                reason = (
                    "short_prompt"
                    if request.num_prompt_tokens < self.min_uncached_tokens
                    else "prefix_cached"
                )
                return Decision(decode.url, None, "decode_only", reason, cached)
        prefills = [
            e
            for e in engines
            if e.role == "prefill"
            and e.compatibility_hash is not None
            and e.compatibility_hash == decode.compatibility_hash
        ]
        if not prefills:
            return Decision(decode.url, None, "decode_only", "no_compatible_prefill", cached)
        if request.adapter is not None:
            prefills = [e for e in prefills if request.adapter in e.adapters]
            if not prefills:
                return Decision(decode.url, None, "decode_only", "no_prefill_with_adapter", cached)
        prefills = [
            e
            for e in prefills
            if e.available
            and e.url not in request.exclude_prefill
            and (e.url, decode.url) not in request.exclude_pairs
        ]
        if not prefills:
            return Decision(decode.url, None, "decode_only", "prefill_unavailable", cached)
        prefills = [e for e in prefills if not self.saturated(e)]
        if not prefills:
            return Decision(decode.url, None, "decode_only", "prefill_saturated", cached)
        prefill, _ = self._best(prefills, request.block_hashes, prefixes)
        return Decision(decode.url, prefill.url, "disaggregated", self.mode, cached)

    def _best(
        self,
        engines: Sequence[EngineSnapshot],
        hashes: Sequence[BlockHash],
        prefixes: ApproxPrefixCache,
    ) -> tuple[EngineSnapshot, int]:
        """The highest-scoring engine and its matched block count (ties, i.e. scores within
        `SCORE_TOLERANCE` of the best: round-robin)."""
        n = len(engines)
        loads = [self.load(engine) for engine in engines]
        lowest, spread = min(loads), max(max(loads) - min(loads), MIN_LOAD_SPREAD)
        scores: list[float] = []
        matches: list[int] = []
        for i, engine in enumerate(engines):
            matched = prefixes.match(engine.url, hashes) if self.prefix_aware and hashes else 0
            score = 0.0
            if self.prefix_aware and hashes:
                score += matched / len(hashes)
            if self.load_aware:
                relative = (loads[i] - lowest) / spread
                score -= RELATIVE_LOAD_WEIGHT * relative + LOAD_WEIGHT * loads[i]
            scores.append(score)
            matches.append(matched)
        floor = max(scores) - SCORE_TOLERANCE
        tied = [i for i in range(n) if scores[i] >= floor]
        chosen = min(tied, key=lambda i: (i - self._turn) % n)
        return engines[chosen], matches[chosen]

    def load(self, engine: EngineSnapshot) -> float:
        """Load in [0, 2]: the queue against the saturation limit, the batch, and KV usage."""
        load = engine.load
        busy = max(load.waiting + load.running, float(engine.in_flight))
        queue = load.waiting / self.saturation_waiting if self.saturation_waiting else 0.0
        return min(1.0, queue) * 0.5 + busy / (busy + 8.0) * 0.5 + min(1.0, load.kv_usage)
