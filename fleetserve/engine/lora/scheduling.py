"""The scheduler's LoRA rule: a step's batch mixes at most `max_loras` adapters."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from fleetserve.engine.request import Request

__all__ = ["lora_fits"]


def lora_fits(request: Request, running: Iterable[Request], max_loras: int | None) -> bool:
    """Whether `request` may join the running requests: it runs the base model, its adapter
    is already running, or fewer than `max_loras` adapters are (None: LoRA is off).

    Every running request counts, scheduled this step or not, so each step's batch holds at
    most `max_loras` adapters and the worker always has a slot for each. A request that does
    not fit waits in the queue (it is not dropped) until a running adapter's requests finish.
    """
    lora = request.lora_request
    if max_loras is None or lora is None:
        return True
    active = {r.lora_request.lora_int_id for r in running if r.lora_request is not None}
    return lora.lora_int_id in active or len(active) < max_loras
