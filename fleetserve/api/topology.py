"""Rank layout of one replica group: a pure function shared by the operator and the engine.

Ranks form the grid (external data, data, pipeline, tensor) in C order, tensor fastest, as the
seed lays them out (notes part 2 §2.4: `arange(world).reshape(-1, DP, PP, TP)`, no context
parallel here): rank = ((e × DP + d) × PP + p) × TP + t, where the leading "external data"
axis (-1 in the reshape) counts independent copies of the DP × PP × TP grid. For world size 8, TP 2, PP 4 the TP groups are
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
    """Tensor-parallel groups: consecutive ranks (TP varies fastest)."""
    pipeline: list[list[int]]
    data: list[list[int]]
    expert: list[list[int]]
    """Expert-parallel groups span DP × TP (one per pipeline stage); singletons when EP is off."""

    def group_of(self, kind: str, rank: int) -> list[int]:
        """The group of kind 'tensor', 'pipeline', 'data' or 'expert' that holds `rank`.

        Raises:
            ValueError: an unknown kind, or a rank outside [0, world_size).
        """
        kinds = ("tensor", "pipeline", "data", "expert")
        if kind not in kinds:
            raise ValueError(f"kind must be one of {kinds}, got {kind!r}")
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        groups: list[list[int]] = getattr(self, kind)
        return next(g for g in groups if rank in g)


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
        world_size: total ranks; a multiple of data × pipeline × tensor (the quotient is the
            external data-parallel axis: independent copies of the grid, e.g. one per trainer).
        tensor, pipeline, data: parallel sizes (each >= 1).
        expert: whether MoE layers shard experts over DP × TP (one EP group per stage).

    Raises:
        ValueError: a size < 1, or world_size not a multiple of data × pipeline × tensor.
    """
    _check_positive("world_size", world_size)
    for name, value in (("tensor", tensor), ("pipeline", pipeline), ("data", data)):
        _check_positive(name, value)
    if world_size % (data * pipeline * tensor) != 0:
        raise ValueError(
            f"world_size must be a multiple of data × pipeline × tensor "
            f"({data}×{pipeline}×{tensor}), got {world_size}"
        )
    external = world_size // (data * pipeline * tensor)
    rng_e, rng_d, rng_p, rng_t = range(external), range(data), range(pipeline), range(tensor)

    def rank(e: int, d: int, p: int, t: int) -> int:
        return ((e * data + d) * pipeline + p) * tensor + t

    # Each group varies one axis (the innermost loop) with the others fixed; the outer loops run
    # in grid order, which lists the groups by ascending first rank.
    tp = [[rank(e, d, p, t) for t in rng_t] for e in rng_e for d in rng_d for p in rng_p]
    pp = [[rank(e, d, p, t) for p in rng_p] for e in rng_e for d in rng_d for t in rng_t]
    dp = [[rank(e, d, p, t) for d in rng_d] for e in rng_e for p in rng_p for t in rng_t]
    if expert:
        ep = [[rank(e, d, p, t) for d in rng_d for t in rng_t] for e in rng_e for p in rng_p]
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
