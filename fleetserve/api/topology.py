"""Rank layout of one replica group: a pure function shared by the operator and the engine.

Ranks are laid out with tensor parallel the fastest-varying dimension, then expert/data, then
pipeline (seed notes part 2 §2.4): for world size 8, TP 2, PP 4 the TP groups are
[[0, 1], [2, 3], [4, 5], [6, 7]] and the PP groups [[0, 2, 4, 6], [1, 3, 5, 7]].
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RankLayout", "group_size", "rank_layout"]


@dataclass(frozen=True, slots=True)
class RankLayout:
    """Process groups of one engine instance, each a list of global ranks."""

    world_size: int
    tensor: list[list[int]]
    pipeline: list[list[int]]
    data: list[list[int]]
    expert: list[list[int]]
    """Expert-parallel groups span DP × TP (one per pipeline stage); singletons when EP is off."""


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def rank_layout(
    world_size: int,
    *,
    tensor: int = 1,
    pipeline: int = 1,
    data: int = 1,
    expert: bool = False,
) -> RankLayout:
    """Split `world_size` ranks into TP/PP/DP/EP groups, TP fastest.

    Args:
        world_size: total ranks; must equal data × pipeline × tensor.
        tensor, pipeline, data: parallel sizes (each >= 1).
        expert: whether MoE layers shard experts over DP × TP.

    Raises:
        ValueError: a size < 1, or world_size != data × pipeline × tensor.
    """
    for name, value in (("world_size", world_size), ("tensor", tensor)):
        _check_positive(name, value)
    _check_positive("pipeline", pipeline)
    _check_positive("data", data)
    if world_size != data * pipeline * tensor:
        raise ValueError(
            f"world_size must equal data × pipeline × tensor ({data}×{pipeline}×{tensor}), "
            f"got {world_size}"
        )

    # NOTE: rank = ((p * data) + d) * tensor + t, i.e. the (pipeline, data, tensor) grid in C order.
    def rank(p: int, d: int, t: int) -> int:
        return (p * data + d) * tensor + t

    tp = [[rank(p, d, t) for t in range(tensor)] for p in range(pipeline) for d in range(data)]
    pp = [[rank(p, d, t) for p in range(pipeline)] for d in range(data) for t in range(tensor)]
    dp = [[rank(p, d, t) for d in range(data)] for p in range(pipeline) for t in range(tensor)]
    if expert:
        ep = [[rank(p, d, t) for d in range(data) for t in range(tensor)] for p in range(pipeline)]
    else:
        ep = [[r] for r in range(world_size)]
    return RankLayout(world_size=world_size, tensor=tp, pipeline=pp, data=dp, expert=ep)


def group_size(tensor: int, pipeline: int, gpus_per_pod: int) -> int:
    """Pods in one replica group: ceil(tensor × pipeline / gpus_per_pod); 1 for CPU (0 GPUs/pod).

    Raises:
        ValueError: a size < 1, or gpus_per_pod < 0.
    """
    _check_positive("tensor", tensor)
    _check_positive("pipeline", pipeline)
    if gpus_per_pod < 0:
        raise ValueError(f"gpus_per_pod must be >= 0, got {gpus_per_pod}")
    if gpus_per_pod == 0:
        return 1
    return -(-(tensor * pipeline) // gpus_per_pod)
