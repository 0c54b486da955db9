"""Front-end checks of a request against the engine, before anything reaches the core.

Torch-free: the API server process validates here, so a bad prompt is a 400 there and never
disturbs the core or the other requests.
"""

from __future__ import annotations

from dataclasses import dataclass

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.sampling_params import SamplingParams

__all__ = ["KVCapacity", "validate_prompt", "validate_without_tokenizer"]


@dataclass(frozen=True, slots=True)
class KVCapacity:
    """The KV cache the engine core really has (it reports it once its worker measured)."""

    num_blocks: int
    """Blocks, the null block 0 included."""
    block_size: int

    @property
    def num_tokens(self) -> int:
        """Tokens one sequence can hold at most (every block but the null block)."""
        return (self.num_blocks - 1) * self.block_size


def validate_prompt(
    prompt_token_ids: list[int],
    params: SamplingParams,
    config: EngineConfig,
    kv_capacity: KVCapacity | None = None,
) -> None:
    """Reject a request before it reaches the engine, so it cannot disturb the others.

    Args:
        kv_capacity: when known, a prompt the whole KV cache cannot hold is refused here (the
            scheduler would refuse it too, only later and less clearly).

    Raises:
        ValueError: empty prompt, prompt not shorter than max_model_len or larger than the KV
            cache, token ids (prompt, stop_token_ids, logit_bias, allowed_token_ids) out of
            the vocabulary. The message starts with the field's name.
    """
    if not prompt_token_ids:
        raise ValueError("prompt must not be empty")
    num_tokens = len(prompt_token_ids)
    max_len = config.model.max_model_len
    if num_tokens >= max_len:
        raise ValueError(
            f"prompt is {num_tokens} tokens long, but max_model_len is {max_len}: "
            "the prompt must be shorter than max_model_len"
        )
    if kv_capacity is not None:
        _check_kv_capacity(num_tokens, params, config, kv_capacity)
    vocab = config.model.vocab_size
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
        raise ValueError(f"prompt_token_ids must be in [0, {vocab}) for this model")
    if any(not 0 <= t < vocab for t in params.stop_token_ids):
        raise ValueError(f"stop_token_ids must be token ids in [0, {vocab}) for this model")
    for token_id in (params.logit_bias or {}).keys() | set(params.allowed_token_ids or ()):
        if not 0 <= token_id < vocab:
            raise ValueError(
                f"token id {token_id} in logit_bias/allowed_token_ids is not in [0, {vocab})"
            )


def _check_kv_capacity(
    num_tokens: int, params: SamplingParams, config: EngineConfig, kv_capacity: KVCapacity
) -> None:
    """The scheduler's own admission rule (`Scheduler.add_request`), stated in tokens."""
    what = f"prompt is {num_tokens} tokens long"
    if config.scheduler.full_sequence_must_fit:
        max_tokens = params.max_tokens or config.model.max_model_len
        num_tokens = min(num_tokens + max_tokens, config.model.max_model_len)
        what = f"prompt plus max_tokens is {num_tokens} tokens (full_sequence_must_fit is on)"
    if num_tokens > kv_capacity.num_tokens:
        raise ValueError(
            f"{what}, but the KV cache holds only {kv_capacity.num_tokens} tokens "
            f"({kv_capacity.num_blocks - 1} blocks of {kv_capacity.block_size}); shorten the "
            "prompt"
        )


def validate_without_tokenizer(params: SamplingParams) -> None:
    """What an engine without a tokenizer (`skip_tokenizer_init`) cannot do.

    Raises:
        ValueError: stop strings, logprobs (both need token text) or structured outputs (a
            grammar is compiled against the tokenizer's vocabulary); the message names the
            field and says why.
    """
    if params.structured_outputs is not None:
        raise ValueError(
            "structured_outputs (response_format, guided_*, forced tool calls) need a "
            "tokenizer, and this engine runs with skip_tokenizer_init"
        )
    if params.stop:
        raise ValueError(
            "stop strings need a tokenizer, and this engine runs with skip_tokenizer_init: "
            "use stop_token_ids"
        )
    for name in ("logprobs", "prompt_logprobs"):
        if getattr(params, name) is not None:
            raise ValueError(
                f"{name} need a tokenizer (they carry token text), and this engine runs with "
                "skip_tokenizer_init"
            )
