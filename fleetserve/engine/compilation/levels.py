"""Optimization levels `-O0`..`-O3`: defaults for the speed knobs that explicit flags override.

Seed notes part 3 §2.8. A level only fills in the knobs the user left unset (`None` in
`EngineArgs`); an explicit value always wins, so `-O2 --enforce-eager` captures no graphs and
`-O0 --attention-backend cpu_paged` still runs the fused attention.

What each level sets in this build:

| level | CUDA graphs (`enforce_eager`) | attention on the CPU ('auto') | RMSNorm, rotary, SiLU-and-mul on the CPU (`--custom-ops auto`) | compile (`compile_min_tokens`) | async scheduling |
|---|---|---|---|---|---|
| O0 | off (`enforce_eager=True`) | the torch reference | eager torch ops | none (0) | off |
| O1 | decode graphs | the fused C++ kernel (`cpu_paged`) | the fused C++ kernels | none (0) | off |
| O2 (default) | decode graphs | the fused C++ kernel | the fused C++ kernels | none (0) | off |
| O3 | decode graphs | the fused C++ kernel | the fused C++ kernels below the compile range | on the CPU, the elementwise pieces of steps of >= 256 tokens (`pieces.py`) | off |

O0 is the debugging level: nothing is compiled (no C++ kernel build, no Inductor) and nothing is
captured, so a wrong result there is the model's, not an optimisation's. O3 is not the default
because its first start compiles with the machine's C++ compiler (about 15 s on 2 cores; later
starts load the cache). A level's async-scheduling default applies only to engines that can
run it (`arg_utils.async_scheduling_blockers`: no speculative decoding, no KV
connector, one rank); an explicit `--async-scheduling` on one that cannot is refused.
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
    """True: 'auto' may pick the fused C++ attention on the CPU (else the torch reference), and
    `--custom-ops auto` runs RMSNorm, rotary and SiLU-and-mul as the fused C++ kernels there."""
    compile_min_tokens: int
    """On the CPU: steps of at least this many tokens run the compiled pieces (0: none)."""
    async_scheduling: bool = False
    """True: schedule step N + 1 while step N runs, where the engine can."""


COMPILE_MIN_TOKENS_O3 = 256
"""Below this, dynamo's guard checks per call cost more than fusing saves (decode batches)."""

_DEFAULTS: dict[int, LevelDefaults] = {
    0: LevelDefaults(enforce_eager=True, fused_cpu_attention=False, compile_min_tokens=0),
    1: LevelDefaults(enforce_eager=False, fused_cpu_attention=True, compile_min_tokens=0),
    2: LevelDefaults(enforce_eager=False, fused_cpu_attention=True, compile_min_tokens=0),
    3: LevelDefaults(
        enforce_eager=False, fused_cpu_attention=True, compile_min_tokens=COMPILE_MIN_TOKENS_O3
    ),
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
    compile_min_tokens: int = 0
    async_scheduling: bool = False


def resolve_knobs(
    level: int,
    device: str,
    enforce_eager: bool | None,
    attention_backend: str,
    compile_min_tokens: int | None = None,
    async_scheduling: bool | None = None,
) -> ResolvedKnobs:
    """Apply `level` to the knobs left unset (`enforce_eager=None`, `attention_backend='auto'`,
    `compile_min_tokens=None`, `async_scheduling=None`).

    On the CPU at a level without fused attention, 'auto' becomes 'torch' (the reference); on
    CUDA 'auto' stays 'auto' (the selector picks the GPU kernels there). The level's compile
    default applies on the CPU only (the compiled pieces are not built for CUDA).
    """
    defaults = level_defaults(level)
    eager = defaults.enforce_eager if enforce_eager is None else enforce_eager
    backend = attention_backend
    if backend == "auto" and device == "cpu" and not defaults.fused_cpu_attention:
        backend = "torch"
    if compile_min_tokens is None:
        compile_min_tokens = defaults.compile_min_tokens if device == "cpu" else 0
    return ResolvedKnobs(
        enforce_eager=eager,
        attention_backend=backend,
        compile_min_tokens=compile_min_tokens,
        async_scheduling=defaults.async_scheduling
        if async_scheduling is None
        else async_scheduling,
    )


def lower_level_hint(level: int, what: str) -> str:
    """An actionable message for a failure of an optimisation at `level` (seed: name the level
    and suggest a lower one)."""
    if level == 0:
        return f"{what} failed at optimization level -O0 (nothing is optimised at -O0)"
    return (
        f"{what} failed at optimization level -O{level}; retry with -O{level - 1} "
        f"(or -O0, which compiles and captures nothing)"
    )
