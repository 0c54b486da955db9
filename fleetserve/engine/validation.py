"""Front-end checks of a request against the engine, before anything reaches the core.

Torch-free: the API server process validates here, so a bad prompt is a 400 there and never
disturbs the core or the other requests.
"""

from __future__ import annotations

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.sampling_params import SamplingParams

__all__ = ["validate_prompt"]


def validate_prompt(
    prompt_token_ids: list[int], params: SamplingParams, config: EngineConfig
) -> None:
    """Reject a request before it reaches the engine, so it cannot disturb the others.

    Raises:
        ValueError: empty prompt, prompt not shorter than max_model_len, or ids out of the vocab.
    """
    if not prompt_token_ids:
        raise ValueError("prompt must not be empty")
    max_len = config.model.max_model_len
    if len(prompt_token_ids) >= max_len:
        raise ValueError(
            f"prompt is {len(prompt_token_ids)} tokens long, but max_model_len is {max_len}: "
            "the prompt must be shorter than max_model_len"
        )
    vocab = config.model.vocab_size
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab:
        raise ValueError(f"prompt_token_ids must be in [0, {vocab}) for this model")
    for token_id in (params.logit_bias or {}).keys() | set(params.allowed_token_ids or ()):
        if not 0 <= token_id < vocab:
            raise ValueError(
                f"token id {token_id} in logit_bias/allowed_token_ids is not in [0, {vocab})"
            )
