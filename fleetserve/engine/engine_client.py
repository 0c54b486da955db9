"""`EngineClient`: what the serving layer needs from an engine, and the errors it may raise.

The HTTP server (`fleetserve/server/`) depends on this Protocol, not on `AsyncLLM`, so tests
can serve a scripted engine in-process (`create_app(config, engine_client=...)`) and a later
client (a data-parallel or remote engine) plugs in without touching the server.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Protocol

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.metrics import StatsLogger
from fleetserve.engine.request_output import RequestOutput
from fleetserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["EngineClient", "EngineDeadError", "EngineOverloadedError"]


class EngineDeadError(RuntimeError):
    """The engine core process is not running; the request cannot complete."""


class EngineOverloadedError(RuntimeError):
    """Too many requests wait already; retry after `retry_after_s`."""

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineClient(Protocol):
    """An engine that serves requests asynchronously: start it, generate, abort, shut it down."""

    @property
    def config(self) -> EngineConfig:
        """The engine's configuration (model limits: `max_model_len`, `vocab_size`)."""
        ...

    @property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        """The model's tokenizer (the server encodes prompts and renders chat with it)."""
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
    def num_waiting(self) -> int:
        """Sequences added and not yet scheduled (what admission control counts)."""
        ...

    async def start(self, timeout_s: float) -> None:
        """Bring the engine up (load the model); raises RuntimeError when it cannot start."""
        ...

    async def shutdown(self) -> None:
        """Stop the engine; requests still in flight fail with `EngineDeadError`."""
        ...

    def check_admission(self) -> None:
        """Raise `EngineDeadError` or `EngineOverloadedError` when no request can be taken now."""
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
        admit: bool = True,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request now; the iterator yields its DELTA outputs until one is `finished`.

        Validation and admission (when `admit`) happen before this returns, so the caller can
        still answer with an HTTP error. Leaving the iteration early aborts the request.

        Raises:
            ValueError: the prompt or params are invalid for this engine (message names the
                field).
            EngineOverloadedError: too many sequences wait already (nothing was added).
            EngineDeadError: the engine is gone (the iterator raises it too, mid-way).
        """
        ...

    def abort(self, request_id: str) -> None:
        """Forget a request and stop its sequences; a no-op when it is unknown or finished."""
        ...
