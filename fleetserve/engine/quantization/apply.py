"""Give every linear layer of a built model its quant method, and finish them after loading.

A layer is matched by its module name (`model.layers.0.self_attn.qkv_proj`) and, for a fused
layer, by the checkpoint names of its parts (`...q_proj`, `...k_proj`, `...v_proj`, from the
model's `stacked_params_mapping`): a pattern that matches some parts of a fused layer but not
all is an error (the parts share one weight, so they are quantized together). Patterns that
match no layer are logged as a warning (a glob typo would otherwise leave layers silently in
full precision).
"""

from __future__ import annotations

import logging
from collections import Counter

import torch
from torch import nn

from fleetserve.engine.layers.linear import Linear
from fleetserve.engine.quantization.compressed_tensors import PackedIntMethod
from fleetserve.engine.quantization.config import LayerPattern, QuantSpec
from fleetserve.engine.quantization.fp8 import Fp8PerTensorMethod
from fleetserve.engine.quantization.int8 import Int8WeightOnlyMethod
from fleetserve.engine.quantization.method import LinearMethod, UnquantizedLinearMethod
from fleetserve.engine.quantization.resolve import QuantizationConfig, online_method_name

__all__ = ["assign_quant_methods", "finish_quantization", "layer_names"]

logger = logging.getLogger(__name__)


def layer_names(model: nn.Module, module_name: str) -> list[str]:
    """The layer's own name, then its checkpoint parts' names when it is a fused layer."""
    mapping = getattr(model, "stacked_params_mapping", None)
    names = [module_name]
    if mapping is None:
        return names
    prefix, _, leaf = module_name.rpartition(".")
    for ckpt_part, fused_part, _shard in mapping():
        if leaf == fused_part:
            names.append(f"{prefix}.{ckpt_part}" if prefix else ckpt_part)
    return names


def _matches(pattern: LayerPattern, names: list[str], field: str) -> bool:
    """Whether `pattern` selects the layer (its name, or every one of its parts).

    Raises:
        ValueError: it selects some parts of a fused layer but not all.
    """
    if pattern.matches(names[0]):
        return True
    parts = names[1:]
    hits = [n for n in parts if pattern.matches(n)]
    if hits and len(hits) != len(parts):
        raise ValueError(
            f"{field} pattern {pattern.text!r} matches {hits} but not all of "
            f"{parts}: they are one fused layer {names[0]!r}, quantized together"
        )
    return bool(parts) and len(hits) == len(parts)


def _online_method(spec: QuantSpec, where: str, device: torch.device) -> LinearMethod:
    name = online_method_name(spec, where)
    if name is None:
        return UnquantizedLinearMethod()
    if name == "int8_per_channel_weight_only":
        return Int8WeightOnlyMethod()
    return Fp8PerTensorMethod(device)


def assign_quant_methods(
    model: nn.Module, quant: QuantizationConfig, dtype: torch.dtype, device: torch.device
) -> dict[str, str]:
    """Set each linear layer's method (re-creating its weights); returns layer → method name.

    Raises:
        ValueError: a pattern splitting a fused layer, or a layer shape a method cannot hold.
    """
    chosen: dict[str, str] = {}
    used: Counter[str] = Counter()
    for module_name, module in model.named_modules():
        if not isinstance(module, Linear):
            continue
        names = layer_names(model, module_name)
        method = _method_for(quant, names, used, device)
        module.set_quant_method(method, dtype, device)
        chosen[module_name] = method.name
    _warn_unmatched(quant, used)
    counts = Counter(chosen.values())
    logger.info("quantization %s: linear layers by method %s", quant.name, dict(counts))
    for method_obj in {type(m.quant_method): m.quant_method for m in _linears(model)}.values():
        reason = getattr(method_obj, "fallback_reason", None)
        if reason is not None:
            logger.warning(
                "fp8_per_tensor falls back to weight-only fp8 (dequantized per call): %s", reason
            )
    return chosen


def _linears(model: nn.Module) -> list[Linear]:
    return [m for m in model.modules() if isinstance(m, Linear)]


def _method_for(
    quant: QuantizationConfig, names: list[str], used: Counter[str], device: torch.device
) -> LinearMethod:
    if quant.checkpoint is not None:
        scheme = quant.checkpoint
        for pattern in scheme.ignore:
            if _matches(pattern, names, "checkpoint quantization_config.ignore"):
                used[f"ignore:{pattern.text}"] += 1
                return UnquantizedLinearMethod()
        if scheme.covers(names):
            return PackedIntMethod(scheme)
        return UnquantizedLinearMethod()
    args = quant.online
    assert args is not None
    for pattern in args.ignore:
        if _matches(pattern, names, "quantization_config.ignore"):
            used[f"ignore:{pattern.text}"] += 1
            return UnquantizedLinearMethod()
    if args.targets:
        # NOTE: an exact name beats a pattern; otherwise the first matching target wins.
        ordered = sorted(args.targets, key=lambda t: not t[0].is_exact)
        for pattern, spec in ordered:
            if _matches(pattern, names, "quantization_config.targets"):
                used[f"targets:{pattern.text}"] += 1
                return _online_method(
                    spec, f"quantization_config.targets[{pattern.text!r}]", device
                )
        return UnquantizedLinearMethod()
    return _online_method(args.linear, "quantization_config.linear", device)


def _warn_unmatched(quant: QuantizationConfig, used: Counter[str]) -> None:
    # NOTE: only the user's patterns: a checkpoint's ignore list names non-linear modules too
    # (lm_head), which would warn on every load.
    if quant.online is None:
        return
    patterns = [("ignore", p) for p in quant.online.ignore]
    patterns += [("targets", p) for p, _ in quant.online.targets]
    for field, pattern in patterns:
        if used[f"{field}:{pattern.text}"] == 0:
            logger.warning(
                "quantization_config.%s pattern %r matches no linear layer of this model "
                "(on this rank's pipeline stage); it has no effect",
                field,
                pattern.text,
            )


def finish_quantization(model: nn.Module) -> None:
    """After loading: each layer's method turns loaded weights into what it applies."""
    with torch.no_grad():
        for layer in _linears(model):
            layer.quant_method.process_weights_after_loading(layer)
