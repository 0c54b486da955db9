"""Pre-quantized checkpoints in the compressed-tensors `pack-quantized` format (weight-only
int4 or int8, symmetric, per group or per channel), dequantized per call in torch
(`compressed_tensors`). This module parses the scheme; it imports no torch.

The format (as llm-compressor writes it): config.json's `quantization_config` has
`quant_method: "compressed-tensors"`, `format: "pack-quantized"`, one config group
`{"targets": ["Linear"], "weights": {"num_bits", "type": "int", "symmetric": true,
"strategy": "group" | "channel", "group_size"}, "input_activations": null}` and an `ignore`
list of layer names. Each quantized linear layer `X` stores `X.weight_packed` (int32
[out, ceil(in / (32 / num_bits))]: value q of column c, offset to unsigned by 2^(num_bits-1),
sits in bits [num_bits * (c % f), ...) of word c // f, f = 32 / num_bits), `X.weight_scale`
([out, in / group_size], or [out, 1] per channel) and `X.weight_shape` ([out, in]; the layer
knows its shape, so it is not read). The weight is q * scale of its group. Ignored layers keep a
plain `X.weight`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleetserve.engine.quantization.config import LayerPattern

__all__ = ["QUANT_METHOD", "CompressedTensorsScheme"]

QUANT_METHOD = "compressed-tensors"


@dataclass(frozen=True, slots=True)
class CompressedTensorsScheme:
    """The one weight scheme of a pack-quantized checkpoint."""

    num_bits: int
    group_size: int | None
    """Input elements per scale; None: one scale per output channel."""
    targets: tuple[LayerPattern, ...]
    """Layers the scheme covers ('Linear': every linear layer)."""
    ignore: tuple[LayerPattern, ...] = ()

    @property
    def pack_factor(self) -> int:
        return 32 // self.num_bits

    @classmethod
    def from_hf(cls, qc: dict[str, Any]) -> CompressedTensorsScheme:
        """Parse config.json's `quantization_config`.

        Raises:
            ValueError: a format, scheme or field this loader does not implement (named).
        """
        where = "config.json quantization_config"
        groups = qc.get("config_groups") or {}
        if not isinstance(groups, dict) or len(groups) != 1:
            raise ValueError(
                f"{where}.config_groups must hold exactly one group (mixed schemes are not "
                f"implemented), got {list(groups) if isinstance(groups, dict) else groups!r}"
            )
        ((group_name, group),) = groups.items()
        g = f"{where}.config_groups.{group_name}"
        fmt = group.get("format") or qc.get("format")
        if fmt != "pack-quantized":
            raise ValueError(f"{where}.format must be 'pack-quantized', got {fmt!r}")
        for name in ("input_activations", "output_activations"):
            if group.get(name) is not None:
                raise ValueError(f"{g}.{name} must be null (only weight-only schemes load)")
        w = group.get("weights") or {}
        checks = (
            ("type", w.get("type"), ("int",)),
            ("num_bits", w.get("num_bits"), (4, 8)),
            ("symmetric", w.get("symmetric"), (True,)),
            ("strategy", w.get("strategy"), ("group", "channel")),
            ("dynamic", w.get("dynamic", False), (False,)),
        )
        for name, value, allowed in checks:
            if value not in allowed:
                raise ValueError(f"{g}.weights.{name} must be one of {allowed}, got {value!r}")
        if w.get("actorder") not in (None, False, "static"):
            raise ValueError(
                f"{g}.weights.actorder must be null or 'static', got {w['actorder']!r}"
            )
        group_size = w.get("group_size") if w["strategy"] == "group" else None
        if w["strategy"] == "group" and not (isinstance(group_size, int) and group_size > 0):
            raise ValueError(
                f"{g}.weights.group_size must be a positive integer, got {group_size!r}"
            )
        targets = group.get("targets") or []
        return cls(
            num_bits=int(w["num_bits"]),
            group_size=group_size,
            targets=tuple(LayerPattern.parse(t, field_name=f"{g}.targets") for t in targets),
            ignore=tuple(
                LayerPattern.parse(p, field_name=f"{where}.ignore") for p in qc.get("ignore") or []
            ),
        )

    def covers(self, names: list[str]) -> bool:
        """Whether a linear layer with these names (fused, then checkpoint parts) is targeted."""
        return any(t.text == "Linear" or any(t.matches(n) for n in names) for t in self.targets)
