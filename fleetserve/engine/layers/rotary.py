"""Rotary position embedding (neox style, as Hugging Face Llama/Qwen2 apply it).

The cos/sin tables are computed once, in float32, for every position up to `max_position`, on the
model's device; each step gathers the rows of its token positions. The inverse frequencies follow
the HF `rope_type` recipes that Llama- and Qwen2-family configs use: "default", "linear", "llama3"
and "yarn" (static YaRN, as HF and vLLM apply it). Both the legacy `rope_scaling` + `rope_theta` keys
and the transformers-v5 `rope_parameters` dict are accepted.
"""

from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED_ROPE_TYPES: tuple[str, ...] = ("default", "linear", "llama3", "yarn")


def rope_parameters(hf_config: dict[str, Any]) -> dict[str, Any]:
    """Normalise a config's RoPE settings into one dict with `rope_type` and `rope_theta`.

    Raises:
        ValueError: the config asks for a rope type this engine does not implement.
    """
    params: dict[str, Any] = dict(
        hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {}
    )
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    params["rope_type"] = rope_type
    params.setdefault("rope_theta", hf_config.get("rope_theta", 10000.0))
    if rope_type in ("llama3", "yarn"):
        params.setdefault(
            "original_max_position_embeddings", hf_config.get("max_position_embeddings", 2048)
        )
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(
            f"rope_scaling.rope_type must be one of {SUPPORTED_ROPE_TYPES}, got {rope_type!r}"
        )
    return params


def _base_inv_freq(base: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (base**exponents)


def _llama3_inv_freq(inv_freq: torch.Tensor, params: dict[str, Any]) -> torch.Tensor:
    factor = float(params["factor"])
    low_freq_factor = float(params["low_freq_factor"])
    high_freq_factor = float(params["high_freq_factor"])
    old_context_len = float(params["original_max_position_embeddings"])
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # NOTE: long wavelengths are interpolated by `factor`, short ones kept, the middle band blended.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    base: float, dim: int, params: dict[str, Any], max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    original_max = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    factor = float(factor) if factor is not None else max_position_embeddings / original_max
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        if mscale and mscale_all_dim:
            attention_factor = get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
        else:
            attention_factor = get_mscale(factor)
    beta_fast = float(params.get("beta_fast") or 32)
    beta_slow = float(params.get("beta_slow") or 1)

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(original_max / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if params.get("truncate", True):
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


def compute_inv_freq(hf_config: dict[str, Any], rotary_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [rotary_dim // 2] (float32, CPU) and the cos/sin scaling factor."""
    params = rope_parameters(hf_config)
    base = float(params["rope_theta"])
    rope_type = params["rope_type"]
    if rope_type == "yarn":
        max_embeddings = int(hf_config.get("max_position_embeddings", 2048))
        return _yarn_inv_freq(base, rotary_dim, params, max_embeddings)
    inv_freq = _base_inv_freq(base, rotary_dim)
    if rope_type == "linear":
        inv_freq = inv_freq / float(params["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, params)
    return inv_freq, 1.0


class RotaryEmbedding:
    """Neox-style RoPE with cos/sin tables precomputed on the model's device.

    Not an `nn.Module`: the tables are derived from the config, not loaded, so they stay out of
    the state dict and are never touched by dtype/device casts of the model.
    """

    def __init__(
        self,
        hf_config: dict[str, Any],
        head_size: int,
        max_position: int,
        dtype: torch.dtype,
        device: torch.device,
        *,
        use_triton: bool = False,
    ) -> None:
        self.use_triton = use_triton
        partial = float(hf_config.get("partial_rotary_factor", 1.0))
        self.rotary_dim = int(head_size * partial)
        self.head_size = head_size
        inv_freq, scaling = compute_inv_freq(hf_config, self.rotary_dim)
        positions = torch.arange(max_position, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        # NOTE: HF duplicates the half-size frequencies to the full rotary dim and casts cos/sin to
        # the activation dtype before multiplying; doing the same keeps bf16 outputs bit-identical.
        emb = torch.cat((freqs, freqs), dim=-1)
        self.cos_cache = (emb.cos() * scaling).to(dtype=dtype, device=device)
        self.sin_cache = (emb.sin() * scaling).to(dtype=dtype, device=device)

    def __call__(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Rotate query [T, H, D] and key [T, Hkv, D] by their token positions [T].

        The torch path returns new tensors; the triton path rotates both in place and returns
        them (callers must use the return values either way).
        """
        if self.use_triton:
            from fleetserve.kernels.rotary import rotary_embedding

            return rotary_embedding(positions, query, key, self.cos_cache, self.sin_cache)
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
