"""The PEFT adapter folder's `adapter_config.json`: parsed and checked (torch-free).

What the engine serves of PEFT's LoRA: `r`, `lora_alpha`, `use_rslora` (scaling alpha/sqrt(r)
instead of alpha/r) and `target_modules` (a list of module-name suffixes, a regex string, or
"all-linear") over the decoder's projections. Everything else that would change the math
(DoRA, biases, `modules_to_save`, per-layer rank or alpha patterns, embedding or LM-head
targets) is refused with a message naming the key, never ignored.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "SUPPORTED_MODULES",
    "PEFTLoRAConfig",
    "read_peft_config",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"

SUPPORTED_MODULES: tuple[str, ...] = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)
"""The checkpoint projection names an adapter may target (the engine's fused qkv_proj and
gate_up_proj take their parts' weights)."""

_EMPTY_OK = ("rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform")


@dataclass(frozen=True, slots=True)
class PEFTLoRAConfig:
    """A checked adapter configuration."""

    r: int
    lora_alpha: float
    use_rslora: bool
    target_modules: tuple[str, ...] | str
    """Module-name suffixes, or a regex (PEFT's rule: a string is matched in full)."""

    @property
    def scaling(self) -> float:
        """What B·A is multiplied by: alpha/r, or alpha/sqrt(r) with rsLoRA."""
        return self.lora_alpha / (self.r**0.5 if self.use_rslora else self.r)

    def targets(self, module_name: str) -> bool:
        """Whether the adapter targets the checkpoint module `module_name` (full dotted name,
        e.g. model.layers.0.self_attn.q_proj), by PEFT's matching rules."""
        if isinstance(self.target_modules, str):
            if self.target_modules == "all-linear":
                return module_name.rsplit(".", 1)[-1] in SUPPORTED_MODULES
            return re.fullmatch(self.target_modules, module_name) is not None
        return any(
            module_name == target or module_name.endswith("." + target)
            for target in self.target_modules
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = ADAPTER_CONFIG) -> PEFTLoRAConfig:
        """Check a parsed adapter_config.json.

        Raises:
            ValueError: not a LoRA adapter, or a key whose value this engine cannot serve
                (each message names `source` and the key).
        """
        kind = data.get("peft_type", "LORA")
        if kind != "LORA":
            raise ValueError(f"{source}: peft_type must be 'LORA', got {kind!r}")
        r = data.get("r")
        if not isinstance(r, int) or r < 1:
            raise ValueError(f"{source}: r must be a positive integer, got {r!r}")
        alpha = data.get("lora_alpha", r)
        if not isinstance(alpha, int | float) or isinstance(alpha, bool) or alpha <= 0:
            raise ValueError(f"{source}: lora_alpha must be a positive number, got {alpha!r}")
        for key in ("use_dora", "fan_in_fan_out"):
            if data.get(key):
                raise ValueError(f"{source}: {key}=true is not supported; only plain LoRA is")
        bias = data.get("bias", "none")
        if bias != "none":
            raise ValueError(
                f"{source}: bias must be 'none' (LoRA biases are not served), got {bias!r}"
            )
        for key in _EMPTY_OK:
            if data.get(key):
                raise ValueError(f"{source}: {key} is not supported; it must be empty or null")
        targets = data.get("target_modules")
        parsed: tuple[str, ...] | str
        if isinstance(targets, str):
            if targets != "all-linear":
                try:
                    re.compile(targets)
                except re.error as exc:
                    raise ValueError(
                        f"{source}: target_modules regex {targets!r} is invalid: {exc}"
                    ) from exc
            parsed = targets
        elif isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets):
            names = sorted(set(targets))
            unsupported = [t for t in names if t.rsplit(".", 1)[-1] not in SUPPORTED_MODULES]
            if unsupported:
                raise ValueError(
                    f"{source}: target_modules {unsupported} are not supported; LoRA is served "
                    f"on {list(SUPPORTED_MODULES)}"
                )
            parsed = tuple(names)
        else:
            raise ValueError(
                f"{source}: target_modules must be a non-empty list of module names or a "
                f"regex string, got {targets!r}"
            )
        return cls(
            r=r,
            lora_alpha=float(alpha),
            use_rslora=bool(data.get("use_rslora", False)),
            target_modules=parsed,
        )


def read_peft_config(path: str | Path) -> PEFTLoRAConfig:
    """Read and check `path`/adapter_config.json (the weights file must exist beside it).

    Raises:
        ValueError: not a PEFT LoRA folder, or a configuration the engine cannot serve.
    """
    folder = Path(path)
    config_file = folder / ADAPTER_CONFIG
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {str(path)!r} must be a PEFT folder with {ADAPTER_CONFIG}")
    if not (folder / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"LoRA adapter {str(path)!r} has no {ADAPTER_WEIGHTS}")
    try:
        data = json.loads(config_file.read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{config_file} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{config_file} must hold a JSON object")
    return PEFTLoRAConfig.from_dict(data, source=str(config_file))
