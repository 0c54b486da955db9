"""Online quantization config: `--quantization` shorthand + `--quantization-config` JSON →
`QuantizationConfigArgs` (the seed's resolution, notes part 3 §2.1).

- `QuantSpec(weight, activation)`: each an optional `QuantKey`; None means "the method's
  default" (defer), never "off".
- `QuantizationConfigArgs(linear, moe, ignore, targets)`: a spec for every linear layer and
  every MoE layer, layer names to leave unquantized, or per-layer specs in `targets` (exclusive
  with `linear`/`moe`: otherwise two specs could apply to one layer).
- `resolve_quantization_config(quantization, quantization_config)`: a shorthand gives a base; a
  config dict is merged over it field by field with `or` (an empty spec or list counts as unset
  and inherits); a name that is not a shorthand with no dict is None (the checkpoint's method
  governs); the deferred shorthands (mxfp4, mxfp8, also checkpoint method names) with no dict are
  None too, so a checkpoint's own metadata wins (`select_online_spec` falls back to them).

Layer patterns (`ignore`, `targets` keys) are exact names, `re:` regexes (compiled here: a bad
one is a ValueError naming it) or fnmatch globs (`layer_match`). This module imports no torch.
"""

from __future__ import annotations

import fnmatch
import re
from dataclasses import dataclass, field
from typing import Any

from fleetserve.engine.quantization.keys import (
    QuantKey,
    coerce_quant_key,
    key_name,
    kFp8DynamicTensorSym,
    kFp8StaticTensorSym,
    kInt8StaticChannelSym,
    kMxfp4Static,
    kMxfp8Static,
)

__all__ = [
    "DEFERRED_SHORTHANDS",
    "ONLINE_QUANT_SHORTHAND_NAMES",
    "LayerPattern",
    "QuantSpec",
    "QuantizationConfigArgs",
    "resolve_quantization_config",
    "select_online_spec",
]


@dataclass(frozen=True, slots=True)
class QuantSpec:
    """How one layer type is quantized: weight and activation keys (None: the method's
    default: the checkpoint's, or none when online)."""

    weight: QuantKey | None = None
    activation: QuantKey | None = None

    def __str__(self) -> str:
        # NOTE: the weight names the spec (the activation is a detail of the method).
        return "unset" if self.weight is None else key_name(self.weight)

    def __bool__(self) -> bool:
        """Empty (both None) counts as unset in the `or`-merge."""
        return self.weight is not None or self.activation is not None


@dataclass(frozen=True, slots=True)
class LayerPattern:
    """One `ignore` entry or `targets` key: exact, `re:` regex or fnmatch glob."""

    text: str
    regex: re.Pattern[str] | None = field(default=None, compare=False)

    @classmethod
    def parse(cls, text: str, *, field_name: str) -> LayerPattern:
        """Raises ValueError naming `field_name` and the pattern when a `re:` regex is bad."""
        if not isinstance(text, str) or not text:
            raise ValueError(f"{field_name} entries must be non-empty strings, got {text!r}")
        if text.startswith("re:"):
            try:
                return cls(text, re.compile(text[3:]))
            except re.error as exc:
                raise ValueError(f"{field_name} has an invalid regex {text!r}: {exc}") from exc
        return cls(text)

    @property
    def is_exact(self) -> bool:
        return self.regex is None and not any(c in self.text for c in "*?[")

    def matches(self, name: str) -> bool:
        if self.regex is not None:
            return self.regex.fullmatch(name) is not None
        if self.is_exact:
            return name == self.text
        return fnmatch.fnmatchcase(name, self.text)


@dataclass(frozen=True, slots=True)
class QuantizationConfigArgs:
    """What to quantize: `linear` and `moe` specs, or per-layer `targets`; `ignore` skips."""

    linear: QuantSpec = field(default_factory=QuantSpec)
    moe: QuantSpec = field(default_factory=QuantSpec)
    ignore: tuple[LayerPattern, ...] = ()
    targets: tuple[tuple[LayerPattern, QuantSpec], ...] = ()

    def __post_init__(self) -> None:
        if self.targets and (self.linear or self.moe):
            raise ValueError(
                "quantization_config.targets is exclusive with quantization_config.linear and "
                ".moe (a layer would have two specs); give per-layer targets or linear/moe"
            )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> QuantizationConfigArgs:
        """Parse the `--quantization-config` JSON object.

        Raises:
            ValueError: an unknown key, a bad spec, key name or regex (each named).
        """
        known = ("linear", "moe", "ignore", "targets")
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"quantization_config keys must be among {list(known)}, got {unknown}")
        ignore = data.get("ignore") or []
        if not isinstance(ignore, list):
            raise ValueError(f"quantization_config.ignore must be a list, got {ignore!r}")
        targets = data.get("targets") or {}
        if not isinstance(targets, dict):
            raise ValueError(f"quantization_config.targets must be an object, got {targets!r}")
        return cls(
            linear=_coerce_spec(data.get("linear"), "linear"),
            moe=_coerce_spec(data.get("moe"), "moe"),
            ignore=tuple(
                LayerPattern.parse(p, field_name="quantization_config.ignore") for p in ignore
            ),
            targets=tuple(
                (
                    LayerPattern.parse(k, field_name="quantization_config.targets"),
                    _coerce_spec(v, f"targets[{k!r}]", allow_shorthand_field="linear"),
                )
                for k, v in targets.items()
            ),
        )

    def merged_over(self, base: QuantizationConfigArgs) -> QuantizationConfigArgs:
        """Field by field `self.x or base.x` (empty counts as unset)."""
        targets = self.targets or base.targets
        linear = self.linear or base.linear
        moe = self.moe or base.moe
        if self.targets and not (self.linear or self.moe):
            # NOTE: user targets replace the shorthand's linear/moe (they are exclusive).
            linear, moe = QuantSpec(), QuantSpec()
        return QuantizationConfigArgs(
            linear=linear, moe=moe, ignore=self.ignore or base.ignore, targets=targets
        )


_ONLINE_SHORTHANDS: dict[str, QuantizationConfigArgs] = {
    "fp8_per_tensor": QuantizationConfigArgs(
        linear=QuantSpec(kFp8StaticTensorSym, kFp8DynamicTensorSym),
        moe=QuantSpec(kFp8StaticTensorSym, kFp8DynamicTensorSym),
    ),
    # NOTE: linear layers only: there is no int8 MoE method, so `moe: "int8..."` is refused.
    "int8_per_channel_weight_only": QuantizationConfigArgs(
        linear=QuantSpec(kInt8StaticChannelSym, None)
    ),
    "mxfp4": QuantizationConfigArgs(linear=QuantSpec(kMxfp4Static), moe=QuantSpec(kMxfp4Static)),
    "mxfp8": QuantizationConfigArgs(linear=QuantSpec(kMxfp8Static), moe=QuantSpec(kMxfp8Static)),
}
SHORTHAND_ALIASES: dict[str, str] = {
    "int8": "int8_per_channel_weight_only",
    "fp8": "fp8_per_tensor",
}
"""vLLM-style short names accepted by `--quantization`."""
DEFERRED_SHORTHANDS: tuple[str, ...] = ("mxfp4", "mxfp8")
"""Shorthands that are also checkpoint method names: a checkpoint's metadata wins."""
ONLINE_QUANT_SHORTHAND_NAMES: tuple[str, ...] = (*_ONLINE_SHORTHANDS, "online")
"""Every `--quantization` value that means online quantization ('online': from the dict)."""


def _coerce_spec(
    value: object, where: str, *, allow_shorthand_field: str | None = None
) -> QuantSpec:
    """A spec from None, a dict {weight, activation}, or a string: a shorthand's spec for this
    field if it names a shorthand, else one key name (the weight).

    Raises:
        ValueError: a shorthand lacking this field, or an unknown name (named).
    """
    if value is None:
        return QuantSpec()
    if isinstance(value, QuantSpec):
        return value
    if isinstance(value, str):
        name = SHORTHAND_ALIASES.get(value, value)
        if name in _ONLINE_SHORTHANDS:
            which = allow_shorthand_field or where
            spec = getattr(_ONLINE_SHORTHANDS[name], which, None)
            if not spec:
                raise ValueError(
                    f"quantization_config.{where}: shorthand {value!r} has no {which} spec; "
                    f"give a quant key name or a {{weight, activation}} object"
                )
            return spec
        return QuantSpec(weight=coerce_quant_key(value, field=f"quantization_config.{where}"))
    if isinstance(value, dict):
        unknown = sorted(set(value) - {"weight", "activation"})
        if unknown:
            raise ValueError(
                f"quantization_config.{where} keys must be among ['activation', 'weight'], "
                f"got {unknown}"
            )
        return QuantSpec(
            weight=_optional_key(value.get("weight"), f"quantization_config.{where}.weight"),
            activation=_optional_key(
                value.get("activation"), f"quantization_config.{where}.activation"
            ),
        )
    raise ValueError(f"quantization_config.{where} must be a name or an object, got {value!r}")


def _optional_key(value: object, where: str) -> QuantKey | None:
    return None if value is None else coerce_quant_key(value, field=where)


def resolve_quantization_config(
    quantization: str | None, quantization_config: dict[str, Any] | None
) -> QuantizationConfigArgs | None:
    """The seed's decision tree (see the module docstring).

    Raises:
        ValueError: 'online' without a config dict, or a bad dict (named).
    """
    name = SHORTHAND_ALIASES.get(quantization or "", quantization)
    if name not in ONLINE_QUANT_SHORTHAND_NAMES:
        if quantization_config is not None:
            raise ValueError(
                f"quantization_config needs quantization to be one of "
                f"{list(ONLINE_QUANT_SHORTHAND_NAMES)}, got {quantization!r}"
            )
        return None
    base = _ONLINE_SHORTHANDS.get(name, QuantizationConfigArgs())
    if quantization_config is None:
        if name == "online":
            raise ValueError("quantization 'online' needs quantization_config (linear/moe/targets)")
        return None if name in DEFERRED_SHORTHANDS else base
    return QuantizationConfigArgs.from_dict(quantization_config).merged_over(base)


def select_online_spec(
    quantization: str | None,
    resolved: QuantizationConfigArgs | None,
    checkpoint_method: str | None,
) -> QuantizationConfigArgs | None:
    """What online quantization the loader applies: the resolved args, or for a deferred
    shorthand with no dict, its online base only when the checkpoint carries no method."""
    if resolved is not None:
        return resolved
    name = SHORTHAND_ALIASES.get(quantization or "", quantization)
    if name in DEFERRED_SHORTHANDS and checkpoint_method is None:
        return _ONLINE_SHORTHANDS[name]
    return None
