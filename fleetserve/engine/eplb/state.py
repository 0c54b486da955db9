"""One EP rank's EPLB: the load window, the rebalance cycle, and the switch to a new placement.

The cycle (every `step_interval` steps, counted after each forward on every rank of the group):

- recording: only during the last `window_size` steps before a rebalance, each MoE layer's
  `expert_load` is a row of one [layers, physical] counter the layer adds its routed physical
  ids to; outside them it is None, so the forward pays nothing. Because recording is limited to
  the window, the window's load is simply that counter's sum since it was armed;
- rebalance (the last step of the interval): the window's load is folded onto logical experts,
  all-reduced over the EPLB CPU group (gloo), and given to the DeepSeek policy (`policy`), a
  pure function, so every rank computes the same plan without exchanging it. The plan is skipped
  when its predicted balancedness beats the placement in use by less than `MIN_GAIN`;
- sync: the weights move (`rearrange`) and the maps are committed before the step returns, on
  the same step on every rank (all ranks rebalance on the same step count);
- async: a background thread stages the moved weights (reading the live ones, which keep
  serving with the old maps); after every later step each rank MIN-reduces "staged" (1), "still
  staging" (0) or "failed" (-1) over the CPU group, and only when every rank has staged do all
  commit weights and maps, on that same step. A failure on any rank raises on every rank.

The layer contract (`MoELayer`): `num_logical_experts`, `num_physical_experts`, `ep_size`,
`ep_rank`, `num_local_physical_experts`, `expert_weights()` (local slot leading), and the two
attributes this module sets: `eplb_maps` (`LayerMaps`) and `expert_load`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist

from fleetserve.engine.eplb.maps import ExpertMaps, default_physical_to_logical
from fleetserve.engine.eplb.policy import POLICIES, balancedness, rebalance
from fleetserve.engine.eplb.rearrange import StagedLayer, commit_layer, plan_moves, stage_layer
from fleetserve.engine.eplb.stats import EplbStats

__all__ = ["MIN_GAIN", "EplbGroup", "EplbSettings", "EplbState", "LayerMaps", "MoELayer"]

MIN_GAIN = 0.05
"""A plan is applied only when its predicted balancedness (mean ÷ max per-rank load, averaged
over layers) exceeds the placement in use's, on the same window, by at least this much: moving
weights for less is not worth a step's stall (vLLM on ROCm skips under 5%)."""


class MoELayer(Protocol):
    """What EPLB needs of a MoE layer (fleetserve.engine.layers' FusedMoE provides it)."""

    num_logical_experts: int
    num_physical_experts: int
    num_local_physical_experts: int
    ep_size: int
    ep_rank: int
    eplb_maps: Any
    expert_load: torch.Tensor | None

    def expert_weights(self) -> list[torch.Tensor]: ...


@dataclass
class LayerMaps:
    """The routing maps one layer reads (on its device; updated in place by a commit)."""

    logical_to_physical: torch.Tensor
    """[logical, max_replicas], -1 padded."""
    logical_replica_count: torch.Tensor
    """[logical]."""


@dataclass(frozen=True, slots=True)
class EplbSettings:
    """The rebalance cycle (from `EPLBConfig`) and the topology the policy packs onto."""

    window_size: int = 1000
    step_interval: int = 3000
    policy: str = "global"
    use_async: bool = False
    num_nodes: int = 1
    """Nodes the EP group spans (the hierarchical policy keeps expert groups inside one)."""
    num_groups: int = 1
    """Expert groups of the model's group-limited routing (1: none)."""
    keep_load_attached: bool = False
    """Leave `expert_load` set on every step (the counter is still zeroed when the window
    starts, so only the window's steps count): for CUDA graphs, which replay the forward as
    captured. Off: outside the window the layers count nothing."""

    def __post_init__(self) -> None:
        for name in ("window_size", "step_interval", "num_nodes", "num_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")


@dataclass
class EplbGroup:
    """The EP ranks' own groups for EPLB, so its exchanges never interleave with the forward's
    collectives: `transfer` moves weights (the device backend), `cpu` (gloo) carries the load
    all-reduce and the readiness vote."""

    ranks: list[int]
    transfer: Any
    cpu: Any

    @classmethod
    def create(cls, expert_groups: Sequence[Sequence[int]], rank: int, backend: str) -> EplbGroup:
        """Every rank of the world calls this with every EP group, in the same order."""
        mine: EplbGroup | None = None
        for ranks in expert_groups:
            transfer = dist.new_group(list(ranks), backend=backend)
            cpu = dist.new_group(list(ranks), backend="gloo")
            if rank in ranks:
                mine = cls(list(ranks), transfer, cpu)
        if mine is None:
            raise ValueError(f"rank {rank} is in no EP group of {expert_groups}")
        return mine


@dataclass
class _Pending:
    """An async rearrangement being staged by `thread`."""

    maps: ExpertMaps
    thread: threading.Thread | None = None
    staged: list[StagedLayer] = field(default_factory=list)
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class EplbState:
    """EPLB over `layers` (this rank's MoE layers, in model order) with `group` (None: one EP
    rank, no collectives)."""

    def __init__(
        self, layers: Sequence[MoELayer], settings: EplbSettings, group: EplbGroup | None = None
    ) -> None:
        if not layers:
            raise ValueError("EPLB needs a model with MoE layers")
        first = layers[0]
        self.layers = list(layers)
        self.settings = settings
        self.group = group
        self.num_ranks = first.ep_size
        self.rank = first.ep_rank
        self.slots_per_rank = first.num_local_physical_experts
        if group is not None and len(group.ranks) != self.num_ranks:
            raise ValueError(
                f"the EPLB group has {len(group.ranks)} ranks, the layers' EP {self.num_ranks}"
            )
        num_logical, num_physical = first.num_logical_experts, first.num_physical_experts
        p2l = [
            list(
                getattr(layer, "physical_to_logical", None)
                or default_physical_to_logical(num_logical, num_physical)
            )
            for layer in self.layers
        ]
        self.maps = ExpertMaps.from_physical_to_logical(torch.tensor(p2l), num_logical)
        self.device = first.expert_weights()[0].device
        self._load = torch.zeros(
            len(self.layers), num_physical, dtype=torch.int64, device=self.device
        )
        self._carry = torch.zeros(len(self.layers), num_logical, dtype=torch.int64)
        """Logical load of the window recorded under a placement replaced since (async)."""
        for index, layer in enumerate(self.layers):
            layer.eplb_maps = LayerMaps(
                self.maps.logical_to_physical[index].to(self.device),
                self.maps.logical_replica_count[index].to(self.device),
            )
            layer.expert_load = None
        self.stats = EplbStats()
        self._steps_in_interval = 0
        self._pending: _Pending | None = None
        self._recording = False
        if settings.keep_load_attached:
            for index, layer in enumerate(self.layers):
                layer.expert_load = self._load[index]
        self._arm()

    @property
    def recording(self) -> bool:
        """Whether the next step's expert load is counted."""
        return self._recording

    @property
    def pending(self) -> bool:
        """Whether an async rearrangement is staged or staging (not yet committed)."""
        return self._pending is not None

    def after_step(self) -> bool:
        """Count one step (every rank calls it after each forward); rebalances at the end of
        an interval, commits a staged async rearrangement once every rank has it. Returns
        whether `stats` changed.

        Raises:
            RuntimeError: an async rearrangement failed on some rank.
        """
        changed = False
        if self._pending is not None:
            changed = self._poll()
        self.stats.steps += 1
        self._steps_in_interval += 1
        if self._steps_in_interval >= self.settings.step_interval:
            self._steps_in_interval = 0
            self._rebalance()
            self._load.zero_()
            self._carry.zero_()
            changed = True
        self._arm()
        return changed

    # -- recording ---------------------------------------------------------------------------

    def _arm(self) -> None:
        """Point the layers' `expert_load` at the counter when the next step is in the window."""
        s = self.settings
        record = self._steps_in_interval >= s.step_interval - s.window_size
        if record and not self._recording:
            self._load.zero_()
            self._carry.zero_()
        if record != self._recording:
            attach = record or s.keep_load_attached
            for index, layer in enumerate(self.layers):
                layer.expert_load = self._load[index] if attach else None
            self._recording = record

    # -- rebalancing -------------------------------------------------------------------------

    def _all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.group is not None and self.num_ranks > 1:
            dist.all_reduce(tensor, group=self.group.cpu)
        return tensor

    def _rebalance(self) -> None:
        physical = self._load.to("cpu")
        num_layers = len(self.layers)
        # NOTE: one all-reduce for both: the window's load under the placement in use (what
        # the measured balancedness is of) and its logical sum (what the policy balances).
        logical = self._carry + self.maps.fold(physical)
        summed = self._all_reduce(torch.cat([physical, logical], dim=1))
        physical, logical = summed.split([self.maps.num_physical, self.maps.num_logical], dim=1)
        if int(logical.sum()) == 0 or self._pending is not None:
            self.stats.skipped += 1
            return
        rank_load = physical.view(num_layers, self.num_ranks, -1).sum(-1)
        self.stats.balancedness = float(balancedness(rank_load).mean())
        current = float(self.maps.balancedness(logical, self.num_ranks).mean())
        self.stats.planned_balancedness = current
        s = self.settings
        p2l = rebalance(
            logical,
            self.maps.num_physical,
            num_ranks=self.num_ranks,
            num_groups=s.num_groups,
            num_nodes=s.num_nodes,
            policy=s.policy,
        )
        new = ExpertMaps.from_physical_to_logical(p2l, self.maps.num_logical)
        planned = float(new.balancedness(logical, self.num_ranks).mean())
        if planned - current < MIN_GAIN:
            self.stats.skipped += 1
            return
        if s.use_async:
            pending = _Pending(new)
            pending.thread = threading.Thread(
                target=self._stage_in_background, args=(pending,), name="eplb-stage", daemon=True
            )
            self._pending = pending
            pending.thread.start()
            return
        started = time.perf_counter()
        self._commit(new, self._stage(new))
        self.stats.last_rearrange_s = time.perf_counter() - started

    def _stage(self, new: ExpertMaps) -> list[StagedLayer]:
        staged = []
        group = self.group
        for index, layer in enumerate(self.layers):
            moves = plan_moves(
                self.maps.physical_to_logical[index].tolist(),
                new.physical_to_logical[index].tolist(),
                self.slots_per_rank,
            )
            staged.append(
                stage_layer(
                    layer.expert_weights(),
                    moves,
                    rank=self.rank,
                    slots_per_rank=self.slots_per_rank,
                    group=None if group is None else group.transfer,
                    group_ranks=None if group is None else group.ranks,
                )
            )
        return staged

    def _stage_in_background(self, pending: _Pending) -> None:
        try:
            if self.device.type == "cuda":
                stream = torch.cuda.Stream(self.device)
                with torch.cuda.stream(stream):
                    pending.staged = self._stage(pending.maps)
                stream.synchronize()
            else:
                pending.staged = self._stage(pending.maps)
        except BaseException as exc:  # reported to every rank by the vote
            pending.error = exc
        pending.done.set()

    def _poll(self) -> bool:
        """The readiness vote of a pending async rearrangement; commits when all have staged."""
        pending = self._pending
        assert pending is not None
        mine = 0 if not pending.done.is_set() else (-1 if pending.error is not None else 1)
        vote = torch.tensor([mine], dtype=torch.int64)
        if self.group is not None and self.num_ranks > 1:
            dist.all_reduce(vote, op=dist.ReduceOp.MIN, group=self.group.cpu)
        vote_min = int(vote.item())
        if vote_min == 0:
            return False
        if pending.thread is not None:
            pending.thread.join()
        self._pending = None
        if vote_min < 0:
            raise RuntimeError(f"EPLB: an async rearrangement failed ({pending.error!r} here)")
        started = time.perf_counter()
        self._commit(pending.maps, pending.staged)
        self.stats.last_rearrange_s = time.perf_counter() - started
        return True

    def _commit(self, new: ExpertMaps, staged: list[StagedLayer]) -> None:
        """Moved weights and the new maps into the layers, in place (the same step on every
        rank). The window being recorded keeps its load, folded under the old placement."""
        self._carry += self.maps.fold(self._load.to("cpu"))
        self._load.zero_()
        for index, layer in enumerate(self.layers):
            commit_layer(layer.expert_weights(), staged[index])
            maps: LayerMaps = layer.eplb_maps
            maps.logical_to_physical.copy_(new.logical_to_physical[index])
            maps.logical_replica_count.copy_(new.logical_replica_count[index])
        self.maps = new
        self.stats.rebalances += 1
