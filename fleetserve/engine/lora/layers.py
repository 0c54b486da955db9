"""`LoRALinear`: a linear layer plus every device slot's adapter weights.

It wraps a loaded `Linear` (replicated or, on one tensor-parallel rank, column- or
row-parallel) without changing it: the base output is computed as before and, in a step where
some token runs under an adapter, the batched LoRA term (`ops.lora_delta`) is added. A fused
projection (q/k/v, gate/up) holds one block per checkpoint part: part i's A sits in rows
[i·R, i·R + r) of a slot and its B only in the part's output columns, so one adapter's q_proj
never leaks into k or v (block-diagonal B).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from fleetserve.engine.layers.linear import Linear
from fleetserve.engine.lora.ops import lora_delta, lora_delta_segmented
from fleetserve.engine.lora.weights import LoRAWeights

__all__ = ["LoRALinear", "LoRAStepState"]


class LoRAStepState:
    """The step's token → slot map every wrapped layer reads (one object per model).

    `token_slots` is a persistent buffer (so a captured graph would read each step's values);
    `active` is False for a step with only base-model tokens, which then skips the LoRA term.
    With `segmented` (the default on the CPU) the layers use `segments` instead: per active
    slot, the indices of its tokens, so each token pays for its own adapter only
    (`ops.lora_delta_segmented`); otherwise the shape-static batched matmul (CUDA): with
    `use_triton` (the default on CUDA) the kernel `fleetserve.kernels.lora`, which reads each
    token's own slot, else the masked torch `ops.lora_delta` (the fallback and the reference).
    """

    def __init__(
        self,
        max_num_tokens: int,
        num_slots: int,
        device: torch.device,
        *,
        segmented: bool | None = None,
    ) -> None:
        self.token_slots = torch.full((max_num_tokens,), -1, dtype=torch.int64, device=device)
        self.slot_ids = torch.arange(num_slots, dtype=torch.int64, device=device)
        self.active = False
        self.segmented = device.type == "cpu" if segmented is None else segmented
        self.use_triton = device.type == "cuda"
        """Whether the unsegmented path runs the Triton kernel (else the masked torch one)."""
        self.segments: list[tuple[int, torch.Tensor]] = []
        """(slot, token indices) of the step's slots, when `segmented`."""


@dataclass(frozen=True, slots=True)
class _Part:
    checkpoint_name: str
    offset: int
    size: int


class LoRALinear(nn.Module):
    """`base` plus `num_slots` adapter slots of rank up to `max_rank`.

    Args:
        base: the loaded layer (kept as is; its forward still computes the base output).
        parts: the checkpoint module names of its fused parts in output order (one when
            unfused), e.g. [...q_proj, ...k_proj, ...v_proj] for qkv_proj.
        state: the model's shared step state.
    """

    lora_a: torch.Tensor
    """[num_slots, parts × max_rank, in]: each slot's A rows, part by part."""
    lora_b: torch.Tensor
    """[num_slots, parts × max_rank, out]: each slot's B, transposed, scaled, block-diagonal."""

    def __init__(
        self,
        base: Linear,
        parts: list[str],
        num_slots: int,
        max_rank: int,
        state: LoRAStepState,
    ) -> None:
        super().__init__()
        self.base = base
        sizes = list(getattr(base, "output_sizes", [base.output_size]))
        if len(sizes) != len(parts):
            raise ValueError(f"{len(parts)} checkpoint parts for {len(sizes)} fused outputs")
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        self.parts = [_Part(n, o, s) for n, o, s in zip(parts, offsets, sizes, strict=True)]
        self.max_rank = max_rank
        self.state = state
        weight = base.weight
        width = len(parts) * max_rank
        self.register_buffer(
            "lora_a",
            torch.zeros(
                num_slots, width, base.input_size, dtype=weight.dtype, device=weight.device
            ),
            persistent=False,
        )
        self.slot_has_weights = [False] * num_slots
        """Whether each slot holds weights for this layer (a segmented step skips the others)."""
        self.register_buffer(
            "lora_b",
            torch.zeros(
                num_slots, width, base.output_size, dtype=weight.dtype, device=weight.device
            ),
            persistent=False,
        )

    @property
    def checkpoint_names(self) -> list[str]:
        return [part.checkpoint_name for part in self.parts]

    def set_lora(self, slot: int, weights: dict[str, LoRAWeights], scaling: float) -> bool:
        """Write an adapter's weights for this layer's parts into `slot` (parts it has no
        weights for stay zero); returns whether any part had weights.

        Raises:
            ValueError: a part's A or B does not fit this layer's shapes.
        """
        self.reset_lora(slot)
        applied = False
        for index, part in enumerate(self.parts):
            pair = weights.get(part.checkpoint_name)
            if pair is None:
                continue
            rank = pair.lora_a.shape[0]
            if pair.lora_a.shape[1] != self.base.input_size or pair.lora_b.shape[0] != part.size:
                raise ValueError(
                    f"LoRA weights of {part.checkpoint_name} have A {tuple(pair.lora_a.shape)} "
                    f"and B {tuple(pair.lora_b.shape)}; the layer takes [r, "
                    f"{self.base.input_size}] and [{part.size}, r]"
                )
            rows = slice(index * self.max_rank, index * self.max_rank + rank)
            cols = slice(part.offset, part.offset + part.size)
            self.lora_a[slot, rows, :] = pair.lora_a.to(self.lora_a.dtype)
            scaled_b = (pair.lora_b * scaling).t()
            self.lora_b[slot, rows, cols] = scaled_b.to(self.lora_b.dtype)
            applied = True
        self.slot_has_weights[slot] = applied
        return applied

    def reset_lora(self, slot: int) -> None:
        """Zero `slot` (a freed slot, or an adapter without weights for this layer)."""
        self.lora_a[slot].zero_()
        self.lora_b[slot].zero_()
        self.slot_has_weights[slot] = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.base(x)
        if not self.state.active:
            return out
        if self.state.segmented:
            segments = [(s, rows) for s, rows in self.state.segments if self.slot_has_weights[s]]
            if segments:
                spans = [(p.offset, p.size) for p in self.parts]
                lora_delta_segmented(
                    out, x, self.lora_a, self.lora_b, segments, spans, self.max_rank
                )
            return out
        slots = self.state.token_slots[: x.shape[0]]
        if self.state.use_triton:
            from fleetserve.kernels.lora import lora_delta_triton

            return out + lora_delta_triton(x, self.lora_a, self.lora_b, slots)
        return out + lora_delta(x, self.lora_a, self.lora_b, slots, self.state.slot_ids)
