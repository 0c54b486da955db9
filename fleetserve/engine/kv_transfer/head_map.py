"""Which KV heads each tensor-parallel rank holds, and where a consumer rank reads its own.

A TP rank caches only its share of the KV heads (`fleetserve.engine.layers.linear`): with H heads
over T ranks, rank r holds heads [r*H/T, (r+1)*H/T) when H >= T (H % T == 0), and the single head
r // (T/H) when H < T (T % H == 0: each head replicated on T/H ranks). Block ids are the same on
every rank of an engine (one scheduler), so a consumer rank's block b needs, for each of its
heads, the same block of a producer rank that holds that head.

`plan_head_slices` says which producer ranks a consumer rank reads and which head slice of their
blocks lands where in its own (the seed's NIXL section: D-worker0 reads the first half of the
heads from P-worker0 ...). Pure functions, no tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["HeadSlice", "KVLayout", "kv_heads_of_rank", "plan_head_slices"]


def kv_heads_of_rank(num_kv_heads: int, rank: int, tp_size: int) -> range:
    """The global KV heads rank `rank` of a TP group of `tp_size` caches, in its cache order.

    Raises:
        ValueError: a rank outside the group, or heads and ranks that do not divide either way.
    """
    if not 0 <= rank < tp_size:
        raise ValueError(f"rank must be in [0, {tp_size}), got {rank}")
    if num_kv_heads >= tp_size:
        if num_kv_heads % tp_size:
            raise ValueError(
                f"num_kv_heads ({num_kv_heads}) is not divisible by tp_size ({tp_size})"
            )
        per_rank = num_kv_heads // tp_size
        return range(rank * per_rank, (rank + 1) * per_rank)
    if tp_size % num_kv_heads:
        raise ValueError(
            f"tp_size ({tp_size}) is not a multiple of num_kv_heads ({num_kv_heads}), so the "
            "replicated KV heads are not spread evenly"
        )
    head = rank // (tp_size // num_kv_heads)
    return range(head, head + 1)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """An engine's KV layout as the handshake exchanges it."""

    tp_size: int
    pp_size: int
    num_kv_heads: int
    """Total KV heads of the model (not per rank)."""
    head_size: int
    block_size: int

    def __post_init__(self) -> None:
        for name in ("tp_size", "pp_size", "num_kv_heads", "head_size", "block_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"KVLayout.{name} must be an int >= 1, got {value!r}")

    def heads_of(self, rank: int) -> range:
        return kv_heads_of_rank(self.num_kv_heads, rank, self.tp_size)

    def describe(self) -> str:
        try:
            heads = ", ".join(f"rank {r}: {_span(self.heads_of(r))}" for r in range(self.tp_size))
        except ValueError:
            heads = "not split evenly over the ranks"
        return (
            f"TP={self.tp_size} PP={self.pp_size}, {self.num_kv_heads} KV heads of "
            f"{self.head_size} ({heads}), blocks of {self.block_size} tokens"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "tp_size": self.tp_size,
            "pp_size": self.pp_size,
            "num_kv_heads": self.num_kv_heads,
            "head_size": self.head_size,
            "block_size": self.block_size,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVLayout:
        """Parse a peer's layout; a missing field is a ValueError naming it."""
        missing = [k for k in ("tp_size", "pp_size", "num_kv_heads", "head_size", "block_size")
                   if k not in data]  # fmt: skip
        if missing:
            raise ValueError(f"KV layout lacks {', '.join(missing)}: {data!r}")
        return cls(
            tp_size=data["tp_size"],
            pp_size=data["pp_size"],
            num_kv_heads=data["num_kv_heads"],
            head_size=data["head_size"],
            block_size=data["block_size"],
        )


def _span(heads: range) -> str:
    return f"head {heads.start}" if len(heads) == 1 else f"heads {heads.start}-{heads.stop - 1}"


@dataclass(frozen=True, slots=True)
class HeadSlice:
    """Heads [src_start, src_start + count) of producer rank `producer_rank`'s blocks (indices in
    that rank's cache) land in heads [dst_start, dst_start + count) of the consumer rank's."""

    producer_rank: int
    src_start: int
    dst_start: int
    count: int


def plan_head_slices(producer: KVLayout, consumer: KVLayout, consumer_rank: int) -> list[HeadSlice]:
    """What consumer rank `consumer_rank` reads: one slice per run of consecutive heads that one
    producer rank holds, in the consumer's head order. A head replicated on several producer
    ranks is read from the producer rank of the same index when it is one of them (so equal
    TP sizes pair rank r with rank r, replicated heads included), else from the lowest.

    Raises:
        ValueError: a pair this connector cannot map (the message names both layouts): pipeline
            parallel on either side, different heads, head sizes or block sizes, or a head layout
            that does not divide.
    """
    pair = f"producer {producer.describe()}; consumer {consumer.describe()}"
    if producer.pp_size != 1 or consumer.pp_size != 1:
        raise ValueError(
            f"KV transfer supports pipeline_parallel_size 1 on both engines only ({pair})"
        )
    for name in ("num_kv_heads", "head_size", "block_size"):
        if getattr(producer, name) != getattr(consumer, name):
            raise ValueError(f"the engines' KV layouts differ in {name} ({pair})")
    try:
        mine = consumer.heads_of(consumer_rank)
        holders = [producer.heads_of(r) for r in range(producer.tp_size)]
    except ValueError as e:
        raise ValueError(f"cannot map KV heads between these engines: {e} ({pair})") from None
    slices: list[HeadSlice] = []
    for dst, head in enumerate(mine):
        owners = [r for r, held in enumerate(holders) if head in held]
        # Same rank when it holds the head (same TP: rank r reads rank r), else the lowest.
        rank = consumer_rank if consumer_rank in owners else owners[0]
        src = head - holders[rank].start
        last = slices[-1] if slices else None
        if (
            last is not None
            and last.producer_rank == rank
            and last.src_start + last.count == src
            and last.dst_start + last.count == dst
        ):
            slices[-1] = HeadSlice(rank, last.src_start, last.dst_start, last.count + 1)
        else:
            slices.append(HeadSlice(rank, src, dst, 1))
    return slices
