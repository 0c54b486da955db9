"""Which fused ops run as custom kernels: `--custom-ops` (vLLM's `custom_ops` semantics).

The value is a comma-separated list: 'all' or 'none' sets the base, '+op' enables and '-op'
disables one op on top of it; without 'all'/'none' the base is the platform's default: every op
on CUDA (the Triton kernels); on the CPU every op from -O1 up (the fused C++ kernels of
`fleetserve.kernels.cpu`, float32) and none at -O0. 'auto' is the platform default alone;
'triton' and 'torch' are the older spellings of 'all' and 'none'. A disabled op runs its torch
reference (the layer's eager code).

The resolved value (`DeviceConfig.custom_ops`, `LayerContext.custom_ops`) is 'triton' (all),
'torch' (none) or '+op,+op' naming exactly the enabled ops. The attention backend chooses its own
cache write (`reshape_and_cache` is a registered custom op, not one of these switches).
This module imports no torch.
"""

from __future__ import annotations

__all__ = ["CUSTOM_OP_NAMES", "is_resolved_custom_ops", "resolve_custom_ops", "uses_custom_op"]

CUSTOM_OP_NAMES: tuple[str, ...] = ("rms_norm", "rotary", "silu_and_mul")
"""The switchable ops, as `--custom-ops` names them."""
_ALIASES = {"triton": "all", "torch": "none"}


def resolve_custom_ops(value: str, device: str, cpu_kernels: bool = False) -> str:
    """The resolved form of a `--custom-ops` value on `device` ('cpu' or 'cuda'); `cpu_kernels`:
    the optimization level runs the fused CPU kernels by default (the CPU's base is all ops).

    Raises:
        ValueError: an unknown item or op name (the message lists the allowed ones).
    """
    items = [item.strip() for item in value.split(",") if item.strip()]
    base = set(CUSTOM_OP_NAMES) if device == "cuda" or cpu_kernels else set()
    enabled = set(base)
    allowed = ("auto", "all", "none", "torch", "triton")
    for item in items or ["auto"]:
        word = _ALIASES.get(item, item)
        if word == "auto":
            enabled = set(base)
        elif word == "all":
            enabled = set(CUSTOM_OP_NAMES)
        elif word == "none":
            enabled = set()
        elif word[:1] in "+-" and word[1:] in CUSTOM_OP_NAMES:
            (enabled.add if word[0] == "+" else enabled.discard)(word[1:])
        else:
            raise ValueError(
                f"custom_ops must be one of {('auto', 'torch', 'triton')} or a comma-separated "
                f"list of {list(allowed[1:3])} and +op/-op with op in {list(CUSTOM_OP_NAMES)}, "
                f"got {value!r}"
            )
    if enabled == set(CUSTOM_OP_NAMES):
        return "triton"
    if not enabled:
        return "torch"
    return ",".join(f"+{name}" for name in CUSTOM_OP_NAMES if name in enabled)


def is_resolved_custom_ops(value: str) -> bool:
    """'triton', 'torch', or '+op,...' of known ops."""
    if value in ("triton", "torch"):
        return True
    items = value.split(",")
    return all(i[:1] == "+" and i[1:] in CUSTOM_OP_NAMES for i in items)


def uses_custom_op(resolved: str, name: str) -> bool:
    """Whether op `name` runs as its custom kernel under the resolved value."""
    if resolved == "triton":
        return True
    if resolved == "torch":
        return False
    return f"+{name}" in resolved.split(",")
