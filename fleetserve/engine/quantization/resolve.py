"""`QuantizationConfig`: the engine's resolved quantization, from `--quantization`,
`--quantization-config` and the checkpoint's `quantization_config` (config.json).

- An online shorthand (or 'online' with a dict) quantizes a full-precision checkpoint's linear
  layers after loading; asking for it on an already quantized checkpoint is an error, except
  for the deferred shorthands (mxfp4, mxfp8), where the checkpoint's own method wins.
- No `--quantization` (or the checkpoint's own method name) and a checkpoint `quantization_config`:
  its method loads the checkpoint (compressed-tensors pack-quantized here; others refused).
- A method name that needs a quantized checkpoint on a full-precision one is an error.

Every spec is checked against the methods this build has, so an unsupported combination fails at
start-up, not at the first forward. This module imports no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fleetserve.engine.quantization.config import (
    DEFERRED_SHORTHANDS,
    ONLINE_QUANT_SHORTHAND_NAMES,
    SHORTHAND_ALIASES,
    QuantizationConfigArgs,
    QuantSpec,
    resolve_quantization_config,
    select_online_spec,
)
from fleetserve.engine.quantization.ct_scheme import (
    QUANT_METHOD,
    CompressedTensorsScheme,
)
from fleetserve.engine.quantization.keys import (
    key_name,
    kFp8DynamicTensorSym,
    kFp8StaticTensorSym,
    kInt8StaticChannelSym,
)

__all__ = [
    "CHECKPOINT_METHODS",
    "QUANTIZATION_CHOICES",
    "QuantizationConfig",
    "online_method_name",
    "resolve_engine_quantization",
]

CHECKPOINT_METHODS: tuple[str, ...] = (QUANT_METHOD,)
"""Checkpoint `quant_method`s this build loads."""
QUANTIZATION_CHOICES: tuple[str, ...] = (
    *ONLINE_QUANT_SHORTHAND_NAMES,
    *SHORTHAND_ALIASES,
    *CHECKPOINT_METHODS,
)
"""Every `--quantization` value (None: from the checkpoint, if it is quantized)."""

_ONLINE_METHODS: dict[QuantSpec, str] = {
    QuantSpec(kInt8StaticChannelSym, None): "int8_per_channel_weight_only",
    QuantSpec(kFp8StaticTensorSym, kFp8DynamicTensorSym): "fp8_per_tensor",
    QuantSpec(kFp8StaticTensorSym, None): "fp8_per_tensor",
}


def online_method_name(spec: QuantSpec, where: str) -> str | None:
    """The online method for a spec (None: an empty spec, the layer stays unquantized).

    Raises:
        ValueError: a spec no online method implements (the message names `where`).
    """
    if not spec:
        return None
    if spec not in _ONLINE_METHODS:
        supported = sorted(
            f"{{weight: {key_name(s.weight)}, activation: "  # type: ignore[arg-type]
            f"{None if s.activation is None else key_name(s.activation)}}}"
            for s in _ONLINE_METHODS
        )
        raise ValueError(
            f"{where} {{weight: {spec.weight and key_name(spec.weight)}, activation: "
            f"{spec.activation and key_name(spec.activation)}}} has no online method in this "
            f"build (mxfp4/mxfp8 and int4 online quantization are not implemented); "
            f"supported: {supported}"
        )
    return _ONLINE_METHODS[spec]


@dataclass(frozen=True, slots=True)
class QuantizationConfig:
    """Exactly one of `online` (quantize after loading) or `checkpoint` (a quantized one)."""

    name: str
    """The method as logged: the shorthand, 'online', or the checkpoint's quant_method."""
    online: QuantizationConfigArgs | None = None
    checkpoint: CompressedTensorsScheme | None = None

    def __post_init__(self) -> None:
        if (self.online is None) == (self.checkpoint is None):
            raise ValueError("QuantizationConfig needs exactly one of online or checkpoint")


def resolve_engine_quantization(
    quantization: str | None,
    quantization_config: dict[str, Any] | None,
    hf_config: dict[str, Any],
) -> QuantizationConfig | None:
    """The engine's quantization (see the module docstring); None: full precision.

    Raises:
        ValueError: an unknown name, a bad dict, a request the checkpoint contradicts, or a
            spec or checkpoint scheme this build does not implement (each named).
    """
    if quantization is not None and quantization not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"quantization must be one of {list(QUANTIZATION_CHOICES)} (or unset), "
            f"got {quantization!r}"
        )
    ckpt = hf_config.get("quantization_config")
    ckpt_method = None if not isinstance(ckpt, dict) else ckpt.get("quant_method")
    resolved = resolve_quantization_config(quantization, quantization_config)
    online = select_online_spec(quantization, resolved, ckpt_method)
    name = SHORTHAND_ALIASES.get(quantization or "", quantization)
    if online is not None:
        if ckpt_method is not None:
            raise ValueError(
                f"quantization {quantization!r} quantizes full-precision weights online, but "
                f"the checkpoint is already quantized (quant_method {ckpt_method!r}); leave "
                f"quantization unset to load it as it is"
            )
        online_method_name(online.linear, "quantization_config.linear")
        for pattern, spec in online.targets:
            online_method_name(spec, f"quantization_config.targets[{pattern.text!r}]")
        if online.moe and _is_moe(hf_config):
            raise ValueError(
                f"quantization {quantization!r} asks for MoE expert quantization "
                f"({online.moe}), which this build does not implement; quantize the linear "
                f"layers only with quantization 'online' and quantization_config "
                f'{{"linear": ...}}'
            )
        return QuantizationConfig(name=str(name), online=online)
    if ckpt_method is not None:
        assert isinstance(ckpt, dict)
        if name not in (None, ckpt_method, *DEFERRED_SHORTHANDS):
            raise ValueError(
                f"quantization {quantization!r} does not match the checkpoint's quant_method "
                f"{ckpt_method!r}; leave quantization unset"
            )
        if ckpt_method not in CHECKPOINT_METHODS:
            raise ValueError(
                f"the checkpoint's quantization_config.quant_method must be one of "
                f"{list(CHECKPOINT_METHODS)} to load, got {ckpt_method!r}"
            )
        return QuantizationConfig(
            name=ckpt_method, checkpoint=CompressedTensorsScheme.from_hf(ckpt)
        )
    if quantization is not None:
        raise ValueError(
            f"quantization {quantization!r} loads a checkpoint quantized with it, but "
            f"config.json has no quantization_config; for online quantization use one of "
            f"{list(ONLINE_QUANT_SHORTHAND_NAMES)}"
        )
    return None


def _is_moe(hf_config: dict[str, Any]) -> bool:
    return any(hf_config.get(k) for k in ("num_local_experts", "num_experts", "n_routed_experts"))
