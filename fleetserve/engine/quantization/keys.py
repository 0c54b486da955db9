"""`QuantKey`: how one tensor is quantized (dtype, scale granularity, static or dynamic,
symmetric), with canonical names.

A key is a plain immutable tuple, so it hashes, compares and pickles; `QUANT_KEY_NAMES` is the
one table of its names (`"fp8_per_tensor_static"` ...), and `coerce_quant_key` turns a name or a
key into a key, refusing unknown names with the list of known ones. This module imports no torch.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = [
    "QUANT_KEY_NAMES",
    "GroupShape",
    "QuantKey",
    "coerce_quant_key",
    "kFp8DynamicTensorSym",
    "kFp8StaticTensorSym",
    "kInt4StaticGroupSym",
    "kInt8StaticChannelSym",
    "kMxfp4Static",
    "kMxfp8Static",
]


class GroupShape(NamedTuple):
    """The block of elements one scale covers: (rows, cols); -1 spans the whole dimension.

    (-1, -1) is one scale per tensor, (1, -1) one per output channel (row), (1, g) one per
    group of g input elements of a row.
    """

    rows: int
    cols: int


PER_TENSOR = GroupShape(-1, -1)
PER_CHANNEL = GroupShape(1, -1)


class QuantKey(NamedTuple):
    """One tensor's quantization."""

    dtype: str
    """'fp8_e4m3', 'int8', 'int4', 'mxfp4', 'mxfp8'."""
    group_shape: GroupShape
    static: bool
    """Scales fixed at load time (True) or computed per call from the tensor (False)."""
    symmetric: bool = True


kFp8StaticTensorSym = QuantKey("fp8_e4m3", PER_TENSOR, static=True)
kFp8DynamicTensorSym = QuantKey("fp8_e4m3", PER_TENSOR, static=False)
kInt8StaticChannelSym = QuantKey("int8", PER_CHANNEL, static=True)
kInt4StaticGroupSym = QuantKey("int4", GroupShape(1, 128), static=True)
kMxfp4Static = QuantKey("mxfp4", GroupShape(1, 32), static=True)
kMxfp8Static = QuantKey("mxfp8", GroupShape(1, 32), static=True)

QUANT_KEY_NAMES: dict[QuantKey, str] = {
    kFp8StaticTensorSym: "fp8_per_tensor_static",
    kFp8DynamicTensorSym: "fp8_per_tensor_dynamic",
    kInt8StaticChannelSym: "int8_per_channel_static",
    kInt4StaticGroupSym: "int4_per_group128_static",
    kMxfp4Static: "mxfp4_static",
    kMxfp8Static: "mxfp8_static",
}
"""Canonical name of each known key (the inverse lookup is `coerce_quant_key`)."""


def coerce_quant_key(value: object, *, field: str) -> QuantKey:
    """A `QuantKey` from a key, its canonical name, or a list/tuple of its fields (JSON).

    Raises:
        ValueError: an unknown name or a malformed value (the message names `field` and the
            known names).
    """
    if isinstance(value, QuantKey):
        return value
    if isinstance(value, str):
        for key, name in QUANT_KEY_NAMES.items():
            if name == value:
                return key
        raise ValueError(
            f"{field} must be one of {sorted(QUANT_KEY_NAMES.values())}, got {value!r}"
        )
    if isinstance(value, list | tuple) and len(value) in (3, 4):
        dtype, shape, static, *rest = value
        if isinstance(shape, list | tuple) and len(shape) == 2:
            return QuantKey(str(dtype), GroupShape(int(shape[0]), int(shape[1])), bool(static),
                            bool(rest[0]) if rest else True)  # fmt: skip
    raise ValueError(
        f"{field} must be a quant key name (one of {sorted(QUANT_KEY_NAMES.values())}), "
        f"got {value!r}"
    )


def key_name(key: QuantKey) -> str:
    """The canonical name, or the tuple's text for a key without one."""
    return QUANT_KEY_NAMES.get(key, str(key))
