"""`EngineClient`: what the serving layer needs from an engine, and the errors it may raise.

The HTTP server (`fleetserve/server/`) depends on this Protocol, not on `AsyncLLM`, so tests
can serve a scripted engine in-process (`create_app(config, engine_client=...)`) and a later
client (a data-parallel or remote engine) plugs in without touching the server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any, Protocol

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.lora.request import LoRARequest
from fleetserve.engine.metrics import StatsLogger
from fleetserve.engine.request_output import RequestOutput
from fleetserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "DEFAULT_MAX_PENDING_OUTPUTS",
    "EngineClient",
    "EngineDeadError",
    "EngineOverloadedError",
    "EngineRequestError",
    "RequestRejectedError",
    "SlowReaderError",
    "check_waiting_bound",
]


DEFAULT_MAX_PENDING_OUTPUTS = 512
"""Outputs one request may leave unread before it is aborted as a slow reader."""


class EngineDeadError(RuntimeError):
    """The engine cannot serve any request (its core process or its output task is gone)."""


class EngineOverloadedError(RuntimeError):
    """Too many requests wait already; retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineRequestError(RuntimeError):
    """The engine failed this one request (the others go on); the message says why."""


class RequestRejectedError(ValueError):
    """The engine core refused a request that passed the front end's checks (bad input the
    front end could not see, e.g. more KV blocks than the cache holds)."""


class SlowReaderError(RuntimeError):
    """The request's reader fell too far behind its outputs; the request was aborted."""


def check_waiting_bound(num_waiting: int, num_sequences: int, max_waiting: int) -> None:
    """Admission of `num_sequences` new sequences, all or nothing, while `num_waiting` wait.

    Raises:
        ValueError: more sequences than may ever wait (retrying cannot help).
        EngineOverloadedError: they do not fit now.
    """
    if num_sequences > max_waiting:
        raise ValueError(
            f"this request asks for {num_sequences} sequences (prompts × n), but the server lets "
            f"at most {max_waiting} wait (max_waiting_requests); send fewer prompts or a smaller n"
        )
    if num_waiting + num_sequences > max_waiting:
        raise EngineOverloadedError(
            f"the server is overloaded: {num_waiting} sequences are waiting and this request "
            f"adds {num_sequences} (max_waiting_requests={max_waiting}); retry later",
            retry_after_s=1,
        )


class EngineClient(Protocol):
    """An engine that serves requests asynchronously: start it, generate, abort, shut it down."""

    @property
    def config(self) -> EngineConfig:
        """The engine's configuration (model limits: `max_model_len`, `vocab_size`)."""
        ...

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase | None:
        """The model's tokenizer (the server encodes prompts and renders chat with it); None
        under `skip_tokenizer_init`, where prompts and outputs are token ids only."""
        ...

    @property
    def stats_logger(self) -> StatsLogger:
        """Feeds the server's periodic one-line stats log."""
        ...

    @property
    def is_healthy(self) -> bool:
        """True while the engine can serve requests."""
        ...

    @property
    def kv_connector(self) -> dict[str, Any] | None:
        """With a KV connector: how peers reach it (engine id, host, port, compatibility hash,
        connector, role, transfer mode); None for a colocated engine."""
        ...

    @property
    def num_waiting(self) -> int:
        """Sequences waiting to be scheduled, preempted ones included, plus those sent to the
        core and not yet seen by it (what admission control counts)."""
        ...

    async def start(self, timeout_s: float) -> None:
        """Bring the engine up (load the model); raises RuntimeError when it cannot start."""
        ...

    async def shutdown(self) -> None:
        """Stop the engine; requests still in flight fail with `EngineDeadError`."""
        ...

    def check_admission(self, num_sequences: int = 1) -> None:
        """Admit `num_sequences` new sequences (all of one HTTP request) or raise.

        Raises:
            EngineDeadError: the engine cannot serve.
            EngineOverloadedError: they do not fit under the waiting bound now.
            ValueError: they could never fit (more than the bound itself).
        """
        ...

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        admit: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request now; the iterator yields its DELTA outputs until one is `finished`.

        Validation and admission of its `params.n` sequences (when `admit`; a caller that
        admitted a whole batch with `check_admission` passes False) happen before this returns,
        so the caller can still answer with an HTTP error. `request_id` must be unique among the
        live requests (a duplicate raises ValueError and leaves the live one alone). Leaving the
        iteration early aborts the request.

        Raises:
            ValueError: the prompt or params are invalid for this engine (message names the
                field).
            EngineOverloadedError: too many sequences wait already (nothing was added).
            EngineDeadError: the engine is gone (the iterator raises it too, mid-way).

        The iterator may also raise `RequestRejectedError` (the core refused the request),
        `EngineRequestError` (the engine failed it) or `SlowReaderError` (aborted because the
        caller read too slowly); each ends that request only.
        """
        ...

    def abort(self, request_id: str) -> None:
        """Forget a request and stop its sequences; a no-op when it is unknown or finished."""
        ...
