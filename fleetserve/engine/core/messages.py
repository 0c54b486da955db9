"""The wire format between the API server process and the EngineCore process (msgpack via msgspec).

The only engine-core module the API process touches: `AsyncLLM` sends `InputMessage`s on its
PUSH socket and decodes `CoreMessage`s from its PULL socket; `engine_core_proc` does the
reverse. Every message is a tagged `msgspec.Struct`, so each union decodes to the right type.
Ids are the core's request ids (an `n > 1` request's children, not the client's parent id).
"""

from __future__ import annotations

from typing import Any

import msgspec

from fleetserve.engine.core.outputs import EngineCoreOutput, SchedulerStats
from fleetserve.engine.lora.request import LoRARequest

__all__ = [
    "AbortMessage",
    "AddRequestMessage",
    "CoreMessage",
    "CoreOutputs",
    "DPWaveMessage",
    "FailedMessage",
    "InputMessage",
    "ReadyMessage",
    "ShutdownMessage",
    "StartWaveMessage",
    "StopMessage",
]

# -- API server → core ------------------------------------------------------------------------


class AddRequestMessage(msgspec.Struct, tag="add"):
    """A validated request (an `n > 1` request arrives as n children)."""

    request_id: str
    prompt_token_ids: list[int]
    params: dict[str, Any]
    """`SamplingParams.to_dict()`."""
    eos_token_ids: list[int]
    arrival_time: float
    """`time.monotonic()` in the API server (CLOCK_MONOTONIC is shared by the processes)."""
    priority: int = 0
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = None
    lora_request: LoRARequest | None = None


class AbortMessage(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class StopMessage(msgspec.Struct, tag="stop"):
    """Finish requests whose stop string the front end matched (FINISHED_STOPPED)."""

    request_ids: list[str]


class ShutdownMessage(msgspec.Struct, tag="shutdown"):
    pass


class StartWaveMessage(msgspec.Struct, tag="start_wave"):
    """Lockstep data parallel: run wave `wave` with the other ranks (sent to every rank;
    `fleetserve.engine.distributed.data_parallel.WaveTracker`)."""

    wave: int


InputMessage = AddRequestMessage | AbortMessage | StopMessage | ShutdownMessage | StartWaveMessage

# -- core → API server ------------------------------------------------------------------------


class ReadyMessage(msgspec.Struct, tag="ready"):
    """The model is loaded; the first message of a core that started, with the KV capacity it
    really has (known only once the worker measured memory), so the front end refuses a prompt
    the cache can never hold before it reaches the core."""

    pid: int
    num_kv_blocks: int
    """KV blocks, the null block 0 included (`num_kv_blocks - 1` hold tokens)."""
    block_size: int
    kv_connector: dict[str, Any] | None = None
    """With a KV connector: how peers reach it (engine id, host, port, hash, role, mode)."""


class FailedMessage(msgspec.Struct, tag="failed"):
    """The core could not start (the only message it sends before exiting)."""

    error: str


class CoreOutputs(msgspec.Struct, tag="outputs"):
    """One step's results; also sent without outputs when only the stats changed."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    scheduled_times: dict[str, float] = msgspec.field(default_factory=dict)
    """Request id → monotonic time of the step that first scheduled it (for queue time)."""
    rejected: dict[str, str] = msgspec.field(default_factory=dict)
    """Request id → error text, for adds the core refused as invalid (a `ValueError`; the front
    end validates first). An add that failed otherwise comes back as an output with `error`."""
    num_adds_processed: int = 0
    """Adds the core has taken off its socket so far (refused ones too): what the front end
    sent minus this is exactly what is still on its way, for admission control."""


class DPWaveMessage(msgspec.Struct, tag="dp_wave"):
    """Lockstep data parallel: wave `wave` ended on this rank ('complete'), or this rank has
    work and no running wave, so asks for wave `wave` to start ('request')."""

    kind: str
    wave: int
    dummy_steps: int = 0
    """'complete': the dummy forwards this rank ran in the wave (it had no work of its own)."""


CoreMessage = ReadyMessage | FailedMessage | CoreOutputs | DPWaveMessage
"""Everything the core sends: `ReadyMessage` or `FailedMessage` once, then `CoreOutputs` (and,
in lockstep data parallel, `DPWaveMessage`)."""
