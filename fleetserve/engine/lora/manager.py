"""The adapters of one model: the host cache, the device slots and the wrapped layers.

Two LRU levels (seed notes part 3 §2.6), independent in size:

- registered: up to `max_cpu_loras` loaded adapters in host memory. Evicting one deactivates
  it too (its device slot is freed), so a slot never outlives its adapter.
- active: up to `max_loras` adapters in device slots; `lora_index_to_id[slot]` names the
  adapter in each slot (None: free). `activate_adapter` is idempotent and raises when no slot
  is free; `set_active_adapters` (what a step calls) first frees the least recently used slots
  the step does not need.

The per-token slot map is rebuilt whenever the batch's adapters or the slot layout change: an
out-of-band activation can move adapters between slots while the batch stays the same.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
from torch import nn

from fleetserve.engine.layers.linear import Linear
from fleetserve.engine.lora.layers import LoRALinear, LoRAStepState
from fleetserve.engine.lora.lru import LRUCache
from fleetserve.engine.lora.peft_config import SUPPORTED_MODULES
from fleetserve.engine.lora.weights import LoRAModel

__all__ = ["LoRAModelManager", "create_lora_modules"]

logger = logging.getLogger(__name__)


def create_lora_modules(
    model: nn.Module,
    stacked: Sequence[tuple[str, str, int]],
    num_slots: int,
    max_rank: int,
    state: LoRAStepState,
) -> dict[str, LoRALinear]:
    """Wrap every supported projection of `model` in place; returns the wrappers by name.

    A fused module (`stacked`: checkpoint part → fused name, index) takes its parts' names.
    A layer reachable by two paths (an alias) gets one wrapper, set at both paths and
    registered once, so resetting one path can never wipe weights set through the other.
    """
    fused: dict[str, list[tuple[int, str]]] = {}
    for part, fused_name, index in stacked:
        fused.setdefault(fused_name, []).append((index, part))
    wrappers: dict[int, LoRALinear] = {}
    named: dict[str, LoRALinear] = {}
    paths = list(model.named_modules(remove_duplicate=False))
    for name, module in paths:
        leaf = name.rsplit(".", 1)[-1]
        if not isinstance(module, Linear) or not (leaf in fused or leaf in SUPPORTED_MODULES):
            continue
        if id(module) not in wrappers:
            prefix = name[: -len(leaf)]
            parts = [prefix + p for _, p in sorted(fused[leaf])] if leaf in fused else [name]
            wrappers[id(module)] = LoRALinear(module, parts, num_slots, max_rank, state)
            named[name] = wrappers[id(module)]
    # NOTE: every path of a wrapped module, whatever it is called there, gets the same wrapper.
    for name, module in paths:
        wrapper = wrappers.get(id(module))
        if wrapper is not None:
            parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
            setattr(parent, name.rsplit(".", 1)[-1], wrapper)
    return named


class LoRAModelManager:
    """Adapter caches and slots over the wrapped layers of one model.

    Args:
        modules: the wrapped layers (`create_lora_modules`).
        state: their shared step state (its `token_slots` are written by `set_adapter_mapping`).
        max_loras: device slots.
        max_cpu_loras: adapters kept loaded in host memory.
    """

    def __init__(
        self,
        modules: dict[str, LoRALinear],
        state: LoRAStepState,
        max_loras: int,
        max_cpu_loras: int,
    ) -> None:
        self.modules = modules
        self.state = state
        self.lora_slots = max_loras
        self.lora_index_to_id: list[int | None] = [None] * max_loras
        self._registered: LRUCache[int, LoRAModel] = LRUCache(max_cpu_loras, self._unregistered)
        self._active: LRUCache[int, int] = LRUCache(max_loras, self._free_slot)
        self._mapping_key: tuple[object, ...] | None = None
        self._warned_empty: set[int] = set()

    # -- host cache ----------------------------------------------------------------------------

    @property
    def registered_ids(self) -> list[int]:
        """Loaded adapters, least recently used first."""
        return list(self._registered)

    @property
    def active_ids(self) -> list[int]:
        """Adapters in device slots, least recently used first."""
        return list(self._active)

    def add_adapter(self, lora: LoRAModel) -> bool:
        """Register a loaded adapter (the LRU one is evicted, and deactivated, when full);
        returns False if it was registered already (then it only becomes the most recent)."""
        if lora.lora_int_id in self._registered:
            self._registered.touch(lora.lora_int_id)
            return False
        self._registered.put(lora.lora_int_id, lora)
        return True

    def touch_adapter(self, lora_id: int) -> None:
        """Mark a registered adapter as just used (it is needed by this step)."""
        self._registered.touch(lora_id)

    def _unregistered(self, lora_id: int, lora: LoRAModel) -> None:
        # NOTE: a slot must never outlive its adapter's host copy (seed: CPU eviction
        # deactivates the device copy too).
        self.deactivate_adapter(lora_id)

    def remove_adapter(self, lora_id: int) -> bool:
        """Unregister (and deactivate) an adapter; returns whether it was registered."""
        return self._registered.pop(lora_id) is not None

    # -- device slots --------------------------------------------------------------------------

    def activate_adapter(self, lora_id: int) -> bool:
        """Put a registered adapter into the first free slot; returns False if it was active.

        Every wrapped layer gets its weights, or a zeroed slot when the adapter has none for it.

        Raises:
            KeyError: the adapter is not registered.
            ValueError: no slot is free ("No free lora slots").
        """
        if lora_id in self._active:
            self._active.touch(lora_id)
            return False
        lora = self._registered.get(lora_id)
        if lora is None:
            raise KeyError(f"LoRA adapter {lora_id} is not registered")
        if None not in self.lora_index_to_id:
            raise ValueError(
                f"No free lora slots: all {self.lora_slots} (max_loras) hold adapters "
                f"{self.lora_index_to_id}"
            )
        slot = self.lora_index_to_id.index(None)
        applied = False
        for module in self.modules.values():
            applied = module.set_lora(slot, lora.weights, lora.scaling) or applied
        if not applied and lora_id not in self._warned_empty:
            # NOTE: normal when this rank holds none of the adapter's layers (pipeline stages).
            self._warned_empty.add(lora_id)
            logger.debug("LoRA adapter %d has no weights for this rank's layers", lora_id)
        self.lora_index_to_id[slot] = lora_id
        self._active.put(lora_id, slot)
        return True

    def deactivate_adapter(self, lora_id: int) -> bool:
        """Free the adapter's slot (zeroed); returns whether it was active."""
        return self._active.pop(lora_id) is not None

    def _free_slot(self, lora_id: int, slot: int) -> None:
        for module in self.modules.values():
            module.reset_lora(slot)
        self.lora_index_to_id[slot] = None

    def set_active_adapters(self, lora_ids: Sequence[int]) -> None:
        """Make `lora_ids` (registered, at most `max_loras`) active, freeing the least recently
        used slots the step does not need.

        Raises:
            ValueError: more adapters than slots (the scheduler admits at most max_loras).
        """
        needed = list(dict.fromkeys(lora_ids))
        if len(needed) > self.lora_slots:
            raise ValueError(
                f"a step needs {len(needed)} adapters but max_loras is {self.lora_slots}"
            )
        for lora_id in needed:
            if lora_id in self._active:
                self._active.touch(lora_id)
        for lora_id in needed:
            if lora_id in self._active:
                continue
            if None not in self.lora_index_to_id:
                victim = next(i for i in self._active if i not in needed)
                self.deactivate_adapter(victim)
            self.activate_adapter(lora_id)

    # -- step mapping --------------------------------------------------------------------------

    def set_adapter_mapping(self, request_ids: Sequence[int], num_tokens: Sequence[int]) -> bool:
        """Write each token's slot for a step whose request i (adapter `request_ids[i]`, 0 =
        base) has `num_tokens[i]` tokens, in the flat token order; rows after them (graph
        padding) run as the base model. Returns whether the map was rebuilt: it is kept while
        both the batch's adapters and the slot layout are unchanged.
        """
        key = (tuple(request_ids), tuple(num_tokens), tuple(self.lora_index_to_id))
        self.state.active = any(request_ids)
        if key == self._mapping_key:
            return False
        slot_of = {lora_id: slot for slot, lora_id in enumerate(self.lora_index_to_id)}
        slots = []
        for lora_id, count in zip(request_ids, num_tokens, strict=True):
            slot = -1 if lora_id == 0 else slot_of[lora_id]
            slots.extend([slot] * count)
        total = len(slots)
        buffer = self.state.token_slots
        if total > buffer.shape[0]:
            raise ValueError(f"a step of {total} tokens exceeds the LoRA map ({buffer.shape[0]})")
        host = torch.tensor(slots, dtype=torch.int64)
        buffer[:total].copy_(host, non_blocking=False)
        buffer[total:].fill_(-1)
        if self.state.segmented:
            self.state.segments = [
                (slot, torch.nonzero(host == slot).flatten().to(buffer.device))
                for slot in sorted({s for s in slots if s >= 0})
            ]
        self._mapping_key = key
        return True
