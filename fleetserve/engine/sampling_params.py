"""`SamplingParams`: per-request decoding settings, vLLM-compatible names and semantics.

Construction validates every field; an invalid value or an unknown keyword raises `ValueError`
naming the field and the allowed range, so a bad request is rejected before it reaches the engine
and never disturbs the other requests of a batch.
"""

from __future__ import annotations

from typing import Any

from fleetserve.engine.structured_output.params import StructuredOutputsParams

SAMPLING_EPS = 1e-5
"""Temperatures below this are treated as greedy (argmax); also guards the division."""

MAX_LOGPROBS = 20
"""Most top logprobs one request may ask for (-1 asks for the whole vocabulary)."""
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
"""Integer fields cross to the engine core as msgpack int64 (a seed as uint64, up to 2**64 - 1,
which is also torch's generator range)."""


class SamplingParams:
    """Decoding settings of one request (see vLLM's `SamplingParams` for the field meanings)."""

    __slots__ = (
        "allowed_token_ids",
        "frequency_penalty",
        "ignore_eos",
        "include_stop_str_in_output",
        "logit_bias",
        "logprobs",
        "max_tokens",
        "min_p",
        "min_tokens",
        "n",
        "presence_penalty",
        "prompt_logprobs",
        "repetition_penalty",
        "seed",
        "stop",
        "stop_token_ids",
        "structured_outputs",
        "temperature",
        "top_k",
        "top_p",
    )

    def __init__(
        self,
        *,
        n: int = 1,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        min_p: float = 0.0,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        repetition_penalty: float = 1.0,
        seed: int | None = None,
        max_tokens: int | None = 16,
        min_tokens: int = 0,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        ignore_eos: bool = False,
        logprobs: int | None = None,
        prompt_logprobs: int | None = None,
        logit_bias: dict[int, float] | None = None,
        allowed_token_ids: list[int] | None = None,
        include_stop_str_in_output: bool = False,
        structured_outputs: StructuredOutputsParams | dict[str, Any] | None = None,
        **unknown: Any,
    ) -> None:
        if unknown:
            allowed = ", ".join(sorted(self.__slots__))
            raise ValueError(
                f"unknown sampling field(s) {sorted(unknown)}; allowed fields are: {allowed}"
            )
        self.n = n
        self.temperature = float(temperature)
        self.top_p = float(top_p)
        # NOTE: vLLM used -1 for "no top-k" before 0; both mean disabled here.
        self.top_k = 0 if top_k == -1 else top_k
        self.min_p = float(min_p)
        self.presence_penalty = float(presence_penalty)
        self.frequency_penalty = float(frequency_penalty)
        self.repetition_penalty = float(repetition_penalty)
        self.seed = seed
        self.max_tokens = max_tokens
        self.min_tokens = min_tokens
        self.stop: list[str] = [stop] if isinstance(stop, str) else list(stop or [])
        self.stop_token_ids: list[int] = list(stop_token_ids or [])
        self.ignore_eos = ignore_eos
        self.logprobs = logprobs
        self.prompt_logprobs = prompt_logprobs
        self.logit_bias = {int(k): float(v) for k, v in logit_bias.items()} if logit_bias else None
        self.allowed_token_ids = list(allowed_token_ids) if allowed_token_ids else None
        self.include_stop_str_in_output = include_stop_str_in_output
        if isinstance(structured_outputs, dict):
            # NOTE: the wire form (`to_dict` through msgpack) arrives as a plain dict.
            structured_outputs = StructuredOutputsParams.from_dict(structured_outputs)
        self.structured_outputs: StructuredOutputsParams | None = structured_outputs
        """The output constraint (JSON schema, regex, choice, grammar), if any."""
        self._validate()

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Build from a plain dict (e.g. a msgpack payload); unknown keys raise ValueError."""
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        """Plain-dict form for crossing process boundaries."""
        values = {name: getattr(self, name) for name in self.__slots__}
        if self.structured_outputs is not None:
            values["structured_outputs"] = self.structured_outputs.to_dict()
        return values

    def clone(self, **changes: Any) -> SamplingParams:
        return SamplingParams(**{**self.to_dict(), **changes})

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.to_dict().items())
        return f"SamplingParams({fields})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, SamplingParams) and self.to_dict() == other.to_dict()

    __hash__ = None  # type: ignore[assignment]

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def stop_buffer_length(self) -> int:
        """Characters held back while streaming so a partial stop string never leaks."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def _validate(self) -> None:
        def check(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {allowed}, got {getattr(self, name)!r}")

        check(isinstance(self.n, int) and 1 <= self.n <= INT64_MAX, "n", "an integer >= 1")
        check(self.temperature >= 0.0, "temperature", ">= 0")
        check(0.0 < self.top_p <= 1.0, "top_p", "in (0, 1]")
        check(
            isinstance(self.top_k, int) and 0 <= self.top_k <= INT64_MAX,
            "top_k",
            f"-1 or 0 (disabled) or an integer in [1, {INT64_MAX}]",
        )
        check(0.0 <= self.min_p <= 1.0, "min_p", "in [0, 1]")
        check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", "in [-2, 2]")
        check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty", "in [-2, 2]")
        check(self.repetition_penalty > 0.0, "repetition_penalty", "> 0")
        check(
            self.seed is None or (isinstance(self.seed, int) and INT64_MIN <= self.seed < 2**64),
            "seed",
            f"None or an integer in [{INT64_MIN}, {2**64 - 1}]",
        )
        check(
            self.max_tokens is None
            or (isinstance(self.max_tokens, int) and 1 <= self.max_tokens <= INT64_MAX),
            "max_tokens",
            f"None or an integer in [1, {INT64_MAX}]",
        )
        check(
            isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= INT64_MAX,
            "min_tokens",
            f"an integer in [0, {INT64_MAX}]",
        )
        if self.max_tokens is not None:
            check(self.min_tokens <= self.max_tokens, "min_tokens", "<= max_tokens")
        check(all(isinstance(s, str) and s for s in self.stop), "stop", "non-empty strings")
        check(
            all(isinstance(t, int) and 0 <= t <= INT64_MAX for t in self.stop_token_ids),
            "stop_token_ids",
            "non-negative int64 integers",
        )
        check(
            self.logprobs is None
            or (isinstance(self.logprobs, int) and -1 <= self.logprobs <= MAX_LOGPROBS),
            "logprobs",
            f"None, -1 (whole vocabulary) or an integer in [0, {MAX_LOGPROBS}]",
        )
        check(
            self.prompt_logprobs is None
            or (
                isinstance(self.prompt_logprobs, int) and -1 <= self.prompt_logprobs <= MAX_LOGPROBS
            ),
            "prompt_logprobs",
            f"None, -1 (whole vocabulary) or an integer in [0, {MAX_LOGPROBS}]",
        )
        check(
            self.structured_outputs is None
            or isinstance(self.structured_outputs, StructuredOutputsParams),
            "structured_outputs",
            "None or a StructuredOutputsParams (or its dict form)",
        )
        if self.logit_bias:
            check(
                all(-100.0 <= v <= 100.0 for v in self.logit_bias.values()),
                "logit_bias",
                "a map of token id to a bias in [-100, 100]",
            )
