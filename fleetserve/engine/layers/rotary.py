"""Rotary position embedding (neox style, as Hugging Face Llama/Qwen2 apply it).

The cos/sin tables are computed once, in float32, for every position up to `max_position`, on the
model's device; each step gathers the rows of its token positions. The inverse frequencies follow
the HF `rope_type` recipes that Llama- and Qwen2-family configs use: "default", "linear", "llama3"
and "yarn" (static YaRN, as HF and vLLM apply it), described by a typed `RopeSettings` (parsed from
config.json's legacy `rope_scaling` + `rope_theta` keys or the transformers-v5 `rope_parameters`
dict by `fleetserve.engine.models.arch`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fleetserve.engine.layers.layer_context import LayerContext

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class RopeSettings:
    """A model's RoPE recipe, typed (`ModelArch.from_hf_config` reads it from config.json).

    Raises (at construction):
        ValueError: a rope type this engine does not implement, or a value its recipe needs is
            missing.
    """

    rope_type: str = "default"
    """One of SUPPORTED_ROPE_TYPES."""
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    """Fraction of each head's dims that rotate (the rest pass through)."""
    max_position_embeddings: int = 2048
    """The model's context length (YaRN's factor defaults to it over the original one)."""
    factor: float | None = None
    """Scaling factor: required by 'linear' and 'llama3'; YaRN derives it when absent."""
    low_freq_factor: float | None = None
    """llama3 only (required there)."""
    high_freq_factor: float | None = None
    """llama3 only (required there)."""
    original_max_position_embeddings: int | None = None
    """llama3 and YaRN: the pre-extension context length (set for both by the parser)."""
    attention_factor: float | None = None
    """YaRN's cos/sin scale; derived from mscale / mscale_all_dim when None."""
    mscale: float | None = None
    mscale_all_dim: float | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    """YaRN: round the correction range to whole dims."""

    def __post_init__(self) -> None:
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(
                f"rope_scaling.rope_type must be one of {SUPPORTED_ROPE_TYPES}, "
                f"got {self.rope_type!r}"
            )
        required: dict[str, tuple[str, ...]] = {
            "linear": ("factor",),
            "llama3": (
                "factor",
                "low_freq_factor",
                "high_freq_factor",
                "original_max_position_embeddings",
            ),
            "yarn": ("original_max_position_embeddings",),
        }
        for name in required.get(self.rope_type, ()):
            if getattr(self, name) is None:
                raise ValueError(
                    f"rope_scaling.{name} is required for rope_type {self.rope_type!r}"
                )


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, rope: RopeSettings) -> torch.Tensor:
    assert rope.factor is not None and rope.low_freq_factor is not None
    assert rope.high_freq_factor is not None and rope.original_max_position_embeddings is not None
    factor = float(rope.factor)
    low_freq_factor = float(rope.low_freq_factor)
    high_freq_factor = float(rope.high_freq_factor)
    old_context_len = float(rope.original_max_position_embeddings)
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # NOTE: long wavelengths are interpolated by `factor`, short ones kept, the middle band blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(base: float, dim: int, rope: RopeSettings) -> tuple[torch.Tensor, float]:
    assert rope.original_max_position_embeddings is not None
    original_max = int(rope.original_max_position_embeddings)
    factor = (
        float(rope.factor)
        if rope.factor is not None
        else rope.max_position_embeddings / original_max
    )
    attention_factor = rope.attention_factor
    if attention_factor is None:
        mscale, mscale_all_dim = rope.mscale, rope.mscale_all_dim

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast, beta_slow = rope.beta_fast, rope.beta_slow

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = base ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation_weight) + (
        1.0 / pos_freqs
    ) * extrapolation_weight
    return inv_freq, float(attention_factor)


def compute_inv_freq(rope: RopeSettings, rotary_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim // 2] (float32, CPU) and the cos/sin scaling factor."""
    base = float(rope.rope_theta)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(base, rotary_dim, rope)
    inv_freq = _base_inv_freq(base, rotary_dim)
    if rope.rope_type == "linear":
        assert rope.factor is not None
        inv_freq = inv_freq / float(rope.factor)
    elif rope.rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, rope)
    return inv_freq, 1.0


class RotaryEmbedding:
    """Neox-style RoPE with cos/sin tables precomputed on the model's device.

    Not an `nn.Module`: the tables are derived from the config, not loaded, so they stay out of
    the state dict and are never touched by dtype/device casts of the model.
    """

    def __init__(
        self, rope: RopeSettings, head_size: int, max_position: int, context: LayerContext
    ) -> None:
        self.use_triton = context.use_custom_op("rotary")
        self.kernel: Callable[..., None] | None = None
        if self.use_triton:
            from fleetserve.kernels.custom_ops import custom_op

            self.kernel = custom_op("rotary_embedding", context.device)
        self.rotary_dim = int(head_size * float(rope.partial_rotary_factor))
        # NOTE: the compiled piece rotates whole heads (partial rotary stays eager).
        full = self.rotary_dim == head_size
        self.pieces = context.pieces if full else None
        self.head_size = head_size
        inv_freq, scaling = compute_inv_freq(rope, self.rotary_dim)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        # NOTE: HF duplicates the half-size frequencies to the full rotary dim and casts cos/sin to
        # the activation dtype before multiplying; doing the same keeps bf16 outputs bit-identical.
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cache = (emb.cos() * scaling).to(dtype=context.dtype, device=context.device)
        self.sin_cache = (emb.sin() * scaling).to(dtype=context.dtype, device=context.device)

    def __call__(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query [T, H, D] and key [T, Hkv, D] by their token positions [T].

        The torch path returns new tensors; the custom op rotates both in place and returns
        them (callers must use the return values either way).
        """
        if self.pieces is not None and self.pieces.applies(positions.shape[0]):
            rotated: tuple[torch.Tensor, torch.Tensor] = self.pieces.rotary(
                positions, query, key, self.cos_cache, self.sin_cache, True
            )
            return rotated
        if self.kernel is not None:
            self.kernel(positions, query, key, self.cos_cache, self.sin_cache, True)
            return query, key
        cos = self.cos_cache[positions].unsqueeze(1)
        sin = self.sin_cache[positions].unsqueeze(1)
        return self._rotate(query, cos, sin), self._rotate(key, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        if self.rotary_dim < self.head_size:
            x_rot, x_pass = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
            return torch.cat((self._rotate(x_rot, cos, sin), x_pass), dim=-1)
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return (x * cos) + (rotated * sin)
