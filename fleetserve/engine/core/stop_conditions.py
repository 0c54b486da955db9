"""When a request stops: the token-level stop conditions the engine core checks each step.

Stop strings are the front end's (they need text); it finishes such requests in the core.
"""

from __future__ import annotations

from fleetserve.engine.request import Request, RequestStatus

__all__ = ["check_stop"]


def check_stop(request: Request, max_seq_len: int) -> bool:
    """Apply the stop conditions after one appended token; sets the FINISHED_* status.

    In order: an EOS id (unless `ignore_eos`) or a stop token id ends it once `min_tokens` are
    out (EOS wins over the length limit); then max_tokens, or the longest sequence the engine
    can hold (`max_seq_len`), caps it. Returns True when the request finished.
    """
    params = request.sampling_params
    over_length = request.num_tokens >= max_seq_len or (
        request.max_tokens is not None and request.num_output_tokens >= request.max_tokens
    )
    if request.num_output_tokens >= params.min_tokens:
        last_token = request.output_token_ids[-1]
        if not params.ignore_eos and last_token in request.eos_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last_token in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token
            return True
    if over_length:
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
