"""`ModelArch`: a typed, validated view of a Hugging Face config.json, built once per engine.

Models, the loader and the worker read the architecture from this view instead of indexing the
raw `hf_config` dict, so a missing or malformed key fails at start-up with a message naming the
key, not deep inside a constructor as a KeyError. Values a specific model class does not support
(a hidden_act other than SiLU, a sliding window shorter than max_model_len) are still refused by
that class; this view only says what the config declares.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fleetserve.engine.layers.rotary import SUPPORTED_ROPE_TYPES, RopeSettings

_MISSING = object()


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _int(config: Mapping[str, Any], key: str, default: object = _MISSING, minimum: int = 1) -> int:
    """config[key] as an int >= minimum (an integral float is accepted, as JSON writers vary)."""
    value = config.get(key, default)
    if value is _MISSING:
        raise ValueError(f"config.json must set {key!r} (an integer >= {minimum})")
    if not _number(value) or int(value) != value or value < minimum:
        raise ValueError(f"config.json {key!r} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _float(config: Mapping[str, Any], key: str, default: object = _MISSING) -> float:
    value = config.get(key, default)
    if value is _MISSING:
        raise ValueError(f"config.json must set {key!r} (a number)")
    if not _number(value):
        raise ValueError(f"config.json {key!r} must be a number, got {value!r}")
    return float(value)


def _optional_float(config: Mapping[str, Any], key: str, where: str) -> float | None:
    value = config.get(key)
    if value is None:
        return None
    if not _number(value):
        raise ValueError(f"config.json {where}{key!r} must be a number, got {value!r}")
    return float(value)


def _bool(config: Mapping[str, Any], key: str, default: bool) -> bool:
    value = config.get(key, default)
    if value is None:
        return False
    if not isinstance(value, bool | int):
        raise ValueError(f"config.json {key!r} must be true or false, got {value!r}")
    return bool(value)


@dataclass(frozen=True, slots=True)
class ModelArch:
    """The architecture a model class is built from (single-rank sizes; TP divides them)."""

    architecture: str
    """config.json `architectures[0]` ('?' when absent: the model registry names the choices)."""
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    """Equal to num_attention_heads when the config has no GQA setting."""
    head_size: int
    """`head_dim` when set, else hidden_size // num_attention_heads."""
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeSettings
    max_position_embeddings: int
    hidden_act: str
    tie_word_embeddings: bool
    attention_bias: bool
    """Biases on q/k/v and o_proj (Llama's `attention_bias`; Qwen2 decides on its own)."""
    mlp_bias: bool
    sliding_window: int | None
    """Window length when the config declares one (0 or null: none)."""
    use_sliding_window: bool | None
    """The config's switch for the window; None when absent (the model class's default rules)."""
    hf_config: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    """The parsed config.json itself, for what a model family reads on its own (MoE routing:
    `fleetserve.engine.models.moe_arch`)."""

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"config.json 'num_attention_heads' ({self.num_attention_heads}) must be a "
                f"multiple of 'num_key_value_heads' ({self.num_key_value_heads})"
            )

    @property
    def q_size(self) -> int:
        """Width of all query heads together."""
        return self.num_attention_heads * self.head_size

    @property
    def kv_size(self) -> int:
        """Width of all key (or value) heads together."""
        return self.num_key_value_heads * self.head_size

    @classmethod
    def from_hf_config(cls, hf_config: Mapping[str, Any]) -> ModelArch:
        """Read and validate the architecture from a parsed config.json.

        Raises:
            ValueError: a required key is missing or a value has the wrong type or range (the
                message names the key), or the RoPE recipe is unsupported or incomplete.
        """
        archs = hf_config.get("architectures") or ["?"]
        hidden_size = _int(hf_config, "hidden_size")
        num_heads = _int(hf_config, "num_attention_heads")
        num_kv_heads = hf_config.get("num_key_value_heads") or num_heads
        head_dim = hf_config.get("head_dim")
        if head_dim:
            head_size = _int(hf_config, "head_dim")
        elif hidden_size % num_heads != 0:
            raise ValueError(
                f"config.json 'hidden_size' ({hidden_size}) must be a multiple of "
                f"'num_attention_heads' ({num_heads}) when 'head_dim' is not set"
            )
        else:
            head_size = hidden_size // num_heads
        if hf_config.get("kv_lora_rank"):
            # NOTE: multi-head latent attention (DeepSeek) caches each head's decompressed K
            # (nope + rope dims) and V (padded to K's size): one KV head per query head.
            head_size = _int(hf_config, "qk_nope_head_dim") + _int(hf_config, "qk_rope_head_dim")
            num_kv_heads = num_heads
        hidden_act = hf_config.get("hidden_act", "silu")
        if not isinstance(hidden_act, str):
            raise ValueError(f"config.json 'hidden_act' must be a string, got {hidden_act!r}")
        window = hf_config.get("sliding_window")
        uses_window = hf_config.get("use_sliding_window")
        max_position_embeddings = _int(hf_config, "max_position_embeddings", 2048)
        return cls(
            architecture=str(archs[0]),
            hidden_size=hidden_size,
            num_hidden_layers=_int(hf_config, "num_hidden_layers"),
            num_attention_heads=num_heads,
            num_key_value_heads=_int({"num_key_value_heads": num_kv_heads}, "num_key_value_heads"),
            head_size=head_size,
            intermediate_size=_int(hf_config, "intermediate_size"),
            vocab_size=_int(hf_config, "vocab_size"),
            rms_norm_eps=_float(hf_config, "rms_norm_eps", 1e-6),
            rope=rope_settings(hf_config, max_position_embeddings),
            max_position_embeddings=max_position_embeddings,
            hidden_act=hidden_act,
            tie_word_embeddings=_bool(hf_config, "tie_word_embeddings", False),
            attention_bias=_bool(hf_config, "attention_bias", False),
            mlp_bias=_bool(hf_config, "mlp_bias", False),
            sliding_window=_int(hf_config, "sliding_window", minimum=0) if window else None,
            use_sliding_window=None if "use_sliding_window" not in hf_config else bool(uses_window),
            hf_config=dict(hf_config),
        )


def rope_settings(hf_config: Mapping[str, Any], max_position_embeddings: int) -> RopeSettings:
    """The RoPE recipe from the transformers-v5 `rope_parameters` dict or the legacy
    `rope_scaling` dict plus a top-level `rope_theta`.

    Raises:
        ValueError: an unsupported rope type, a missing value the recipe needs, or a non-number.
    """
    params = dict(hf_config.get("rope_parameters") or hf_config.get("rope_scaling") or {})
    rope_type = str(params.get("rope_type", params.get("type", "default")))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        # NOTE: before any other rope key is read: other recipes carry keys of other shapes.
        raise ValueError(
            f"rope_scaling.rope_type must be one of {SUPPORTED_ROPE_TYPES}, got {rope_type!r}"
        )
    where = "rope_scaling."
    theta = params.get("rope_theta", hf_config.get("rope_theta", 10000.0))
    if not _number(theta):
        raise ValueError(f"config.json 'rope_theta' must be a number, got {theta!r}")
    original_max = params.get("original_max_position_embeddings")
    if original_max is None and rope_type in ("llama3", "yarn"):
        original_max = max_position_embeddings
    if original_max is not None and (not _number(original_max) or int(original_max) < 1):
        raise ValueError(
            f"config.json {where}'original_max_position_embeddings' must be a positive "
            f"integer, got {original_max!r}"
        )
    return RopeSettings(
        rope_type=rope_type,
        rope_theta=float(theta),
        partial_rotary_factor=_float(hf_config, "partial_rotary_factor", 1.0),
        max_position_embeddings=max_position_embeddings,
        factor=_optional_float(params, "factor", where),
        low_freq_factor=_optional_float(params, "low_freq_factor", where),
        high_freq_factor=_optional_float(params, "high_freq_factor", where),
        original_max_position_embeddings=None if original_max is None else int(original_max),
        attention_factor=_optional_float(params, "attention_factor", where),
        mscale=_optional_float(params, "mscale", where),
        mscale_all_dim=_optional_float(params, "mscale_all_dim", where),
        beta_fast=float(params.get("beta_fast") or 32),
        beta_slow=float(params.get("beta_slow") or 1),
        truncate=bool(params.get("truncate", True)),
    )
