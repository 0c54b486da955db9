"""Rank layout of one replica group: a pure function shared by the operator and the engine.

Ranks form the grid (data, pipeline, tensor) in C order, tensor fastest, as the seed lays them
out (notes part 2 §2.4: `arange(world).reshape(-1, DP, PP, TP)`, no context parallel here):
rank = (d × PP + p) × TP + t. For world size 8, TP 2, PP 4 the TP groups are
[[0, 1], [2, 3], [4, 5], [6, 7]] and the PP groups [[0, 2, 4, 6], [1, 3, 5, 7]]; for DP 2, PP 2,
TP 2 the PP groups are [[0, 2], [1, 3], [4, 6], [5, 7]], the DP groups [[0, 4], [1, 5], [2, 6],
[3, 7]] and the EP groups (DP × TP per pipeline stage) [[0, 1, 4, 5], [2, 3, 6, 7]].
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["RankLayout", "group_size", "rank_layout", "world_size"]


@dataclass(frozen=True, slots=True)
class RankLayout:
    """Process groups of one engine instance, each a list of global ranks.

    Every group lists its ranks in ascending order, and each kind lists its groups in ascending
    order of their first rank, so the layout is identical on every rank and easy to compare.
    """

    world_size: int
    tensor: list[list[int]]
    pipeline: list[list[int]]
    data: list[list[int]]
    expert: list[list[int]]
    """Expert-parallel groups span DP × TP (one per pipeline stage); singletons when EP is off."""


def _check_positive(name: str, value: int) -> None:
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")


def world_size(*, tensor: int, pipeline: int, data: int) -> int:
    """Ranks in one replica group: tensor × pipeline × data.

    Raises:
        ValueError: a size < 1.
    """
    for name, value in (("tensor", tensor), ("pipeline", pipeline), ("data", data)):
        _check_positive(name, value)
    return tensor * pipeline * data


def rank_layout(
    world_size: int,
    *,
    tensor: int = 1,
    pipeline: int = 1,
    data: int = 1,
    expert: bool = False,
) -> RankLayout:
    """Split `world_size` ranks into TP/PP/DP/EP groups on the (DP, PP, TP) grid, TP fastest.

    Args:
        world_size: total ranks; must equal data × pipeline × tensor.
        tensor, pipeline, data: parallel sizes (each >= 1).
        expert: whether MoE layers shard experts over DP × TP (one EP group per stage).

    Raises:
        ValueError: a size < 1, or world_size != data × pipeline × tensor.
    """
    _check_positive("world_size", world_size)
    for name, value in (("tensor", tensor), ("pipeline", pipeline), ("data", data)):
        _check_positive(name, value)
    if world_size != data * pipeline * tensor:
        raise ValueError(
            f"world_size must equal data × pipeline × tensor ({data}×{pipeline}×{tensor}), "
            f"got {world_size}"
        )

    def rank(d: int, p: int, t: int) -> int:
        return (d * pipeline + p) * tensor + t

    # Each group varies one axis (the innermost loop) with the others fixed; the outer loops run
    # in grid order, which lists the groups by ascending first rank.
    tp = [[rank(d, p, t) for t in range(tensor)] for d in range(data) for p in range(pipeline)]
    pp = [[rank(d, p, t) for p in range(pipeline)] for d in range(data) for t in range(tensor)]
    dp = [[rank(d, p, t) for d in range(data)] for p in range(pipeline) for t in range(tensor)]
    if expert:
        ep = [[rank(d, p, t) for d in range(data) for t in range(tensor)] for p in range(pipeline)]
    else:
        ep = [[r] for r in range(world_size)]
    return RankLayout(world_size=world_size, tensor=tp, pipeline=pp, data=dp, expert=ep)


def group_size(*, tensor: int, pipeline: int, data: int, gpus_per_pod: int) -> int:
    """Pods in one replica group: ceil(tensor × pipeline × data / gpus_per_pod); 1 on CPU.

    A CPU pod (gpus_per_pod 0) runs one rank, so its group is one pod.

    Raises:
        ValueError: a size < 1, or gpus_per_pod < 0.
    """
    ranks = world_size(tensor=tensor, pipeline=pipeline, data=data)
    if gpus_per_pod < 0:
        raise ValueError(f"gpus_per_pod must be >= 0, got {gpus_per_pod}")
    if gpus_per_pod == 0:
        return 1
    return -(-ranks // gpus_per_pod)
