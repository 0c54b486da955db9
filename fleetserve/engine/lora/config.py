"""`LoRAConfig`: the engine's multi-LoRA settings (frozen; built by `EngineArgs`)."""

from __future__ import annotations

from dataclasses import dataclass

from fleetserve.engine.lora.peft_config import read_peft_config

__all__ = ["LoRAConfig", "LoRAModulePath", "parse_lora_modules"]

SUPPORTED_MAX_RANKS: tuple[int, ...] = (8, 16, 32, 64, 128, 256)


@dataclass(frozen=True, slots=True)
class LoRAModulePath:
    """An adapter served from start-up (`--lora-modules name=path`)."""

    name: str
    path: str


@dataclass(frozen=True, slots=True)
class LoRAConfig:
    """How many adapters the engine holds where.

    `max_loras` adapters sit in the device's slots at once (a step's batch mixes at most that
    many, and the scheduler holds back a request whose adapter would be one more);
    `max_cpu_loras` loaded adapters are cached in host memory, least recently used evicted
    first (its device slot, if any, is freed with it).
    """

    max_loras: int = 1
    max_cpu_loras: int = 1
    max_lora_rank: int = 16
    """The largest adapter rank served (every slot is this wide; smaller ranks are padded)."""
    lora_modules: tuple[LoRAModulePath, ...] = ()

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras must be >= max_loras ({self.max_loras}), got {self.max_cpu_loras}"
            )
        if self.max_lora_rank not in SUPPORTED_MAX_RANKS:
            raise ValueError(
                f"max_lora_rank must be one of {SUPPORTED_MAX_RANKS}, got {self.max_lora_rank}"
            )
        names = [m.name for m in self.lora_modules]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"lora_modules names must be unique, got {duplicates} twice")

    def check_adapter(self, name: str, path: str) -> None:
        """Raises ValueError (naming the adapter) unless `path` is a servable PEFT adapter whose
        rank fits `max_lora_rank`."""
        try:
            peft = read_peft_config(path)
        except ValueError as exc:
            raise ValueError(f"LoRA adapter {name!r}: {exc}") from exc
        if peft.r > self.max_lora_rank:
            raise ValueError(
                f"LoRA adapter {name!r} has rank {peft.r}, above max_lora_rank "
                f"({self.max_lora_rank}); raise --max-lora-rank"
            )


def parse_lora_modules(items: list[str] | None) -> tuple[LoRAModulePath, ...]:
    """`name=path` items (vLLM's `--lora-modules` form) → module paths.

    Raises:
        ValueError: an item without `=`, or with an empty name or path.
    """
    modules = []
    for item in items or []:
        name, sep, path = item.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"lora_modules items must be name=path, got {item!r}")
        modules.append(LoRAModulePath(name.strip(), path.strip()))
    return tuple(modules)
