"""Optimization levels `-O0`..`-O3`: defaults for the speed knobs that explicit flags override.

Seed notes part 3 §2.8. A level only fills in the knobs the user left unset (`None` in
`EngineArgs`); an explicit value always wins, so `-O2 --enforce-eager` captures no graphs and
`-O0 --attention-backend cpu_paged` still runs the fused attention.

What each level sets in this build:

| level | CUDA graphs (`enforce_eager`) | attention on the CPU ('auto') | compile |
|---|---|---|---|
| O0 | off (`enforce_eager=True`) | the torch reference | none |
| O1 | decode graphs | the fused C++ kernel (`cpu_paged`) | none |
| O2 (default) | decode graphs | the fused C++ kernel | none |
| O3 | = O2 (reserved) | = O2 | none |

O0 is the debugging level: nothing is compiled (no C++ kernel build, no Inductor) and nothing is
captured, so a wrong result there is the model's, not an optimisation's. `torch.compile` of the
model is not built yet, so no level compiles the model (the compile column is what the config
records); async scheduling is not built either and has no knob.
"""

from __future__ import annotations

from dataclasses import dataclass

OPTIMIZATION_LEVELS: tuple[int, ...] = (0, 1, 2, 3)
DEFAULT_LEVEL = 2


@dataclass(frozen=True)
class LevelDefaults:
    """The knob values one level gives to whatever the user left unset."""

    enforce_eager: bool
    """True: never capture CUDA graphs."""
    fused_cpu_attention: bool
    """True: 'auto' may pick the fused C++ attention on the CPU (else the torch reference)."""


_DEFAULTS: dict[int, LevelDefaults] = {
    0: LevelDefaults(enforce_eager=True, fused_cpu_attention=False),
    1: LevelDefaults(enforce_eager=False, fused_cpu_attention=True),
    2: LevelDefaults(enforce_eager=False, fused_cpu_attention=True),
    3: LevelDefaults(enforce_eager=False, fused_cpu_attention=True),
}


def level_defaults(level: int) -> LevelDefaults:
    """The defaults of `level`.

    Raises:
        ValueError: `level` is not one of 0..3 (the message names `optimization_level`).
    """
    if level not in _DEFAULTS:
        raise ValueError(
            f"optimization_level must be one of {list(OPTIMIZATION_LEVELS)}, got {level!r}"
        )
    return _DEFAULTS[level]


@dataclass(frozen=True)
class ResolvedKnobs:
    """The concrete knob values after the level filled in the unset ones."""

    enforce_eager: bool
    attention_backend: str


def resolve_knobs(
    level: int, device: str, enforce_eager: bool | None, attention_backend: str
) -> ResolvedKnobs:
    """Apply `level` to the knobs left unset (`enforce_eager=None`, `attention_backend='auto'`).

    On the CPU at a level without fused attention, 'auto' becomes 'torch' (the reference); on
    CUDA 'auto' stays 'auto' (the selector picks the GPU kernels there).
    """
    defaults = level_defaults(level)
    eager = defaults.enforce_eager if enforce_eager is None else enforce_eager
    backend = attention_backend
    if backend == "auto" and device == "cpu" and not defaults.fused_cpu_attention:
        backend = "torch"
    return ResolvedKnobs(enforce_eager=eager, attention_backend=backend)


def lower_level_hint(level: int, what: str) -> str:
    """An actionable message for a failure of an optimisation at `level` (seed: name the level
    and suggest a lower one)."""
    if level == 0:
        return f"{what} failed at optimization level -O0 (nothing is optimised at -O0)"
    return (
        f"{what} failed at optimization level -O{level}; retry with -O{level - 1} "
        f"(or -O0, which compiles and captures nothing)"
    )
