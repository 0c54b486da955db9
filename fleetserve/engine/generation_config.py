"""Where sampling defaults come from: `--generation-config auto|vllm|FOLDER` (seed part 3 §2.9).

- 'auto' (the default): the model folder's `generation_config.json`, when it has one;
- 'vllm': neutral defaults (temperature 1, top_p 1, no top_k/min_p, no repetition penalty);
- a folder: that folder's `generation_config.json` (it must exist).

Only the sampling keys vLLM takes from the file are read: temperature, top_p, top_k, min_p,
repetition_penalty and max_new_tokens (a default `max_tokens`). A request's own value always
wins; a value the request leaves unset comes from here, then from the neutral default. The
effective defaults are logged when the config is resolved. This module imports no torch.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

__all__ = ["GENERATION_CONFIG_SOURCES", "GenerationDefaults", "load_generation_defaults"]

logger = logging.getLogger(__name__)

GENERATION_CONFIG_SOURCES: tuple[str, ...] = ("auto", "vllm")
"""The named sources (anything else is a folder)."""
_KEYS: dict[str, str] = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


@dataclass(frozen=True, slots=True)
class GenerationDefaults:
    """Sampling defaults for fields a request leaves unset (None: the neutral default)."""

    source: str = "vllm"
    """Where they came from: 'vllm' (neutral) or the generation_config.json path."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def overrides(self) -> dict[str, Any]:
        """The `SamplingParams` keywords this source sets."""
        return {k: v for k, v in asdict(self).items() if k != "source" and v is not None}


def load_generation_defaults(value: str, model_dir: str) -> GenerationDefaults:
    """Resolve `--generation-config` for the model in `model_dir`, and log the result.

    Raises:
        ValueError: a folder without generation_config.json, or a file that is not a JSON
            object (each named).
    """
    if value == "vllm":
        defaults = GenerationDefaults()
    else:
        folder = Path(model_dir if value == "auto" else value)
        path = folder / "generation_config.json"
        if not path.is_file():
            if value != "auto":
                raise ValueError(
                    f"generation_config must be one of {GENERATION_CONFIG_SOURCES} or a folder "
                    f"with generation_config.json, got {value!r}"
                )
            defaults = GenerationDefaults()
        else:
            defaults = _from_file(path)
    shown = defaults.overrides() or "neutral (temperature 1, top_p 1, top_k off, min_p off)"
    logger.info("sampling defaults from %s: %s", defaults.source, shown)
    return defaults


def _from_file(path: Path) -> GenerationDefaults:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"generation_config {str(path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"generation_config {str(path)!r} must hold a JSON object")
    picked: dict[str, Any] = {}
    for key, field_name in _KEYS.items():
        value = data.get(key)
        if value is None:
            continue
        kind = int if field_name in ("top_k", "max_tokens") else float
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(
                f"generation_config {str(path)!r}: {key} must be a number, got {value!r}"
            )
        picked[field_name] = kind(value)
    return GenerationDefaults(source=str(path), **picked)
