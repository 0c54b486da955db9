"""`torch.compile` of the elementwise pieces between the GEMMs and attention, for large steps.

Seed notes part 2 §2.9–2.11 (compilation with a persistent cache, piecewise around attention,
ranges on the token count only), narrowed to what pays on the CPU. The GEMMs run through oneDNN
(`fleetserve.engine.layers.gemm`) and attention through the fused C++ kernel; what eager torch
does worst is the chain of small ops around them: the residual add and RMSNorm (five kernels,
each a full pass over the activations), the rotary embedding (gather, negate, concatenate, two
products) and SiLU-and-mul. Inductor fuses each chain into one vectorized C++ loop: a 2048-token
add + RMSNorm of SmolLM2 takes 0.36 ms instead of 3.9 eagerly.

What is compiled, and when:
- each piece is its own graph (attention and the GEMMs are never inside one: piecewise by
  construction), compiled once with the token count as the only dynamic dimension, so every
  layer and every step size shares the one compiled kernel;
- a step runs the compiled pieces only when it computes at least `min_tokens` tokens (the
  compile range): below that, dynamo's per-call guard checks (~15 µs) cost more than the fusion
  saves, so decode batches stay eager;
- the compiled code lives in Inductor's on-disk FX-graph cache under
  `<cache>/compile/<key>`, the key hashing what the generated code depends on (torch's version,
  the dtype, the widths, eps, the rotary layout), so a second start with the same config compiles
  nothing: its graphs are cache hits (`compile_counts`, logged at warm-up).

The compiled functions are the torch references of `fleetserve.kernels.reference`, which
reproduce the layers' eager arithmetic exactly, so there is one definition of each op.

Eager stays the reference: -O0..-O2 compile nothing (`levels.py`), and `compile_min_tokens=0`
turns it off at any level.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fleetserve.kernels.reference import rms_norm_ref, rotary_ref, silu_and_mul_ref

__all__ = ["CompileCounts", "CompiledPieces", "compile_counts"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CompileCounts:
    """Inductor's FX-graph cache outcomes in this process: misses are graphs it compiled."""

    compiled: int
    cache_hits: int


def compile_counts() -> CompileCounts:
    """Graphs Inductor compiled (cache misses) and loaded from its cache, in this process."""
    from torch._dynamo.utils import counters

    inductor = counters["inductor"]
    return CompileCounts(
        compiled=int(inductor["fxgraph_cache_miss"]), cache_hits=int(inductor["fxgraph_cache_hit"])
    )


def _compile(fn: Callable[..., Any], token_args: tuple[int, ...]) -> Callable[..., Any]:
    """`fn` compiled with one dynamic dimension: dim 0 (the token count) of its arguments at
    positions `token_args` (those passed); every other size is static (guarded), so each width
    compiles once and a width that happens to equal the token count cannot fold into it."""
    compiled = torch.compile(fn, fullgraph=True)

    def call(*args: Any) -> Any:
        for index in token_args:
            if index < len(args) and args[index] is not None:
                torch._dynamo.mark_dynamic(args[index], 0)
        return compiled(*args)

    return call


class CompiledPieces:
    """One engine's compiled pieces (not module state: each engine configures its own).

    Args:
        min_tokens: steps computing at least this many tokens run the compiled pieces (> 0).
        cache_root: where the compile caches live (`<cache_root>/<key>`).
        key_parts: what the generated code depends on besides torch's version (dtype, widths,
            eps, rotary layout); hashed into the cache folder's name.
    """

    def __init__(self, min_tokens: int, cache_root: Path, key_parts: tuple[Any, ...]) -> None:
        if min_tokens <= 0:
            raise ValueError(f"compile_min_tokens must be > 0 to compile, got {min_tokens}")
        self.min_tokens = min_tokens
        digest = hashlib.sha256(repr((torch.__version__, *key_parts)).encode()).hexdigest()
        self.cache_dir = cache_root / digest[:16]
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        # NOTE: Inductor reads its cache folder from the environment at each compile; the engine
        # process is this engine's own, so setting it here scopes it to the engine.
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(self.cache_dir)
        # NOTE: the pieces are the torch references of the layers' ops (`kernels.reference`,
        # which reproduce the layers' eager arithmetic exactly), compiled.
        self.rms_norm = _compile(rms_norm_ref, token_args=(0, 3))
        """(x, weight, eps[, residual]) → normed, or (normed, summed) with a residual."""
        self.silu_and_mul = _compile(silu_and_mul_ref, token_args=(0,))
        self.rotary = _compile(rotary_ref, token_args=(0, 1, 2))
        """(positions, query, key, cos_cache, sin_cache, is_neox) → rotated copies."""

    def applies(self, num_tokens: int) -> bool:
        """Whether a step of `num_tokens` tokens runs the compiled pieces (the compile range)."""
        return num_tokens >= self.min_tokens

    def log_warm_up(self, before: CompileCounts) -> CompileCounts:
        """Log what warming up compiled (misses) and found cached; returns this warm-up's counts."""
        after = compile_counts()
        done = CompileCounts(after.compiled - before.compiled, after.cache_hits - before.cache_hits)
        logger.info(
            "torch.compile of the elementwise pieces (steps of >= %d tokens): %d graphs compiled, "
            "%d from the cache at %s",
            self.min_tokens,
            done.compiled,
            done.cache_hits,
            self.cache_dir,
        )
        return done
