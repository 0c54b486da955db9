"""`LoRARequest`: which adapter a request runs under (travels from the server to the worker)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoRARequest"]


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """One adapter, as a request names it.

    The worker loads the adapter from `lora_path` the first time a batch needs it (and again
    after its CPU cache evicted it), so the request carries everything the worker needs: no
    separate load message has to reach every rank first.
    """

    lora_name: str
    """The name clients send as `model` (also the prefix-cache key: see `block_hash`)."""
    lora_int_id: int
    """The engine-wide id the worker's caches and slot table key on (>= 1; 0 is the base)."""
    lora_path: str
    """The PEFT adapter folder (adapter_config.json + adapter_model.safetensors)."""

    def __post_init__(self) -> None:
        if not self.lora_name:
            raise ValueError("lora_name must be a non-empty string")
        if self.lora_int_id < 1:
            raise ValueError(
                f"lora_int_id must be >= 1 (0 is the base model), got {self.lora_int_id}"
            )
