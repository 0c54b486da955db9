"""Data parallel inside one engine (torch-free): the ranks' configs, load balancing, waves.

`--data-parallel-size N` runs N engine cores behind one API server (`fleetserve.engine.
dp_async_llm.DPAsyncLLM`), each with its own scheduler, KV cache and executor (its own
tensor × pipeline ranks). Two modes, chosen by `ParallelConfig.needs_dp_lockstep`:

- independent replicas (dense models, or MoE without expert parallelism): the cores never talk
  to each other; each is an engine with data_parallel_size 1 over its own devices;
- lockstep (MoE with expert parallelism: the EP group spans DP × TP, so every forward of every
  rank meets the others in the MoE layers' collectives): all ranks' workers share one
  torch.distributed world, and the cores step in "waves" (`WaveTracker` here, the core side in
  `data_parallel_lockstep`): while any rank has work every rank runs a forward each step (an
  idle one a dummy batch), and they all stop together once none has work.

The front end balances requests over the ranks by load (`pick_rank`); the router balances pods.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

from fleetserve.engine.config import EngineConfig

__all__ = ["DPCoreSpec", "WaveTracker", "pick_rank", "rank_config", "visible_devices"]


@dataclass(frozen=True, slots=True)
class DPCoreSpec:
    """What one data-parallel rank's core process is told at spawn (besides its config)."""

    rank: int
    size: int
    lockstep: bool
    """Step in waves with the other ranks (see the module docstring)."""
    wave_address: str | None = None
    """Lockstep only: tcp://host:port of the cores' own gloo group (rank 0 hosts its store)."""
    visible_devices: str | None = None
    """CUDA_VISIBLE_DEVICES for this rank's core and workers (None: leave it alone, CPU)."""

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"rank must be in [0, {self.size}), got {self.rank}")
        if self.lockstep and self.wave_address is None:
            raise ValueError("wave_address is required for a lockstep rank")


def rank_config(config: EngineConfig, rank: int, init_method: str | None) -> EngineConfig:
    """The config of data-parallel rank `rank`'s engine core.

    An independent replica is an engine of its own: data_parallel_size 1 (its rank is known
    to its core from `DPCoreSpec` only), so its executor, workers and groups are those of an
    engine without data parallel, over the devices `DPCoreSpec.visible_devices` leaves it. A lockstep rank keeps the DP size
    (its workers are ranks [rank × TP × PP, (rank + 1) × TP × PP) of the whole world, which they
    join at `init_method`).

    Raises:
        ValueError: a rank outside [0, data_parallel_size), or a lockstep rank without
            `init_method`.
    """
    parallel = config.parallel
    size = parallel.data_parallel_size
    if not 0 <= rank < size:
        raise ValueError(f"rank must be in [0, {size}), got {rank}")
    if parallel.needs_dp_lockstep:
        if init_method is None:
            raise ValueError("init_method is required for a lockstep data-parallel rank")
        parallel = dataclasses.replace(
            parallel, data_parallel_rank=rank, data_parallel_init_method=init_method
        )
    else:
        parallel = dataclasses.replace(parallel, data_parallel_size=1)
    return dataclasses.replace(config, parallel=parallel)


def visible_devices(rank: int, devices_per_rank: int, inherited: str | None) -> str:
    """CUDA_VISIBLE_DEVICES of data-parallel rank `rank`: its consecutive slice of the devices
    the server sees (`inherited`, the server's own CUDA_VISIBLE_DEVICES, else 0, 1, ...).

    Raises:
        ValueError: `inherited` lists fewer devices than the ranks need.
    """
    first = rank * devices_per_rank
    if inherited is None or not inherited.strip():
        return ",".join(str(d) for d in range(first, first + devices_per_rank))
    listed = [d.strip() for d in inherited.split(",") if d.strip()]
    if len(listed) < first + devices_per_rank:
        raise ValueError(
            f"CUDA_VISIBLE_DEVICES={inherited!r} lists {len(listed)} devices; data-parallel "
            f"rank {rank} needs devices [{first}, {first + devices_per_rank})"
        )
    return ",".join(listed[first : first + devices_per_rank])


def pick_rank(loads: Sequence[int], cursor: int) -> int:
    """The rank a new request goes to: the least loaded, ties broken round-robin.

    Args:
        loads: per rank, its waiting + running requests (what the front end knows now).
        cursor: the rank the round-robin starts from (the caller advances it past the pick).

    Raises:
        ValueError: no ranks.
    """
    if not loads:
        raise ValueError("loads must name at least one rank")
    least = min(loads)
    size = len(loads)
    return next(r % size for r in range(cursor, cursor + size) if loads[r % size] == least)


class WaveTracker:
    """The front end's view of the lockstep waves (pure bookkeeping, no I/O).

    Waves are numbered 0, 1, ... on every core alike. A core runs wave w once it was told to
    start a wave >= w; every core ends it on the same step (their all-reduce says nobody has
    work) and reports it. The front end starts a wave when it sends a request and no wave it
    knows of is running, and again when a core asks (a request reached a core whose wave had
    just ended, before the front end learnt it).
    """

    def __init__(self) -> None:
        self.completed = 0
        """Waves every core has reported finished (the next wave's number)."""
        self.started = -1
        """The highest wave number a start was sent for."""

    @property
    def running(self) -> bool:
        """Whether the front end believes a wave runs (started and not reported complete)."""
        return self.started >= self.completed

    def on_request(self) -> int | None:
        """A request is being sent: the wave to start first, or None when one runs."""
        if self.running:
            return None
        self.started = self.completed
        return self.started

    def on_complete(self, wave: int) -> None:
        """A core reported that wave `wave` ended (each core reports it; repeats are no-ops)."""
        self.completed = max(self.completed, wave + 1)

    def on_core_request(self, wave: int) -> int | None:
        """A core that has work but no running wave asks for wave `wave`: the wave to start,
        or None when a start for it was already sent."""
        self.completed = max(self.completed, wave)
        if wave <= self.started:
            return None
        self.started = wave
        return wave
