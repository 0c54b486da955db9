"""Moving expert weights to a new placement: the plan (pure), the exchange, and the commit.

Each EP rank holds the physical slots [rank × k, (rank + 1) × k) of every MoE layer, as tensors
whose leading dim is the local slot (k = slots per rank). For a new `physical_to_logical`:

- `plan_moves` (pure, identical on every rank) lists, per slot whose expert changes, where its
  new expert's weights come from: a slot of the same rank when one holds it (a local copy),
  otherwise the lowest slot holding it in the old placement (a point-to-point transfer);
- `stage_layer` fills staging buffers with the moved slots' new contents, reading only the live
  weights (which keep serving meanwhile): local copies, plus one batched exchange of isend/irecv
  over the EPLB transfer group, whose order every rank derives from the same plan;
- `commit_layer` writes the staged slots into the live tensors in place (`index_copy_`), so
  the tensors' storage never changes (CUDA graphs and the layer keep their pointers).

Staging holds only the slots that change, so its memory is the moved experts' size.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Move", "StagedLayer", "commit_layer", "plan_moves", "stage_layer"]


@dataclass(frozen=True, slots=True)
class Move:
    """Slot `dst` (global physical id) takes the weights held now by slot `src`."""

    src: int
    dst: int


def plan_moves(old: Sequence[int], new: Sequence[int], slots_per_rank: int) -> list[Move]:
    """The moves that turn placement `old` into `new` (both physical → logical), dst ascending.

    Raises:
        ValueError: placements of different sizes, or a new expert no old slot holds.
    """
    if len(old) != len(new) or len(old) % slots_per_rank:
        raise ValueError(
            f"placements must have the same size, a multiple of {slots_per_rank} slots per rank;"
            f" got {len(old)} and {len(new)}"
        )
    holders: dict[int, list[int]] = {}
    for slot, expert in enumerate(old):
        holders.setdefault(expert, []).append(slot)
    moves = []
    for dst, expert in enumerate(new):
        if old[dst] == expert:
            continue
        if expert not in holders:
            raise ValueError(f"logical expert {expert} is in no slot of the old placement")
        rank = dst // slots_per_rank
        local = [s for s in holders[expert] if s // slots_per_rank == rank]
        moves.append(Move(src=(local or holders[expert])[0], dst=dst))
    return moves


@dataclass
class StagedLayer:
    """A layer's moved slots (local indices) and their new contents, one buffer per weight."""

    local_slots: torch.Tensor
    buffers: list[torch.Tensor]


def stage_layer(
    weights: Sequence[torch.Tensor],
    moves: Sequence[Move],
    *,
    rank: int,
    slots_per_rank: int,
    group: dist.ProcessGroup | None = None,
    group_ranks: Sequence[int] | None = None,
) -> StagedLayer:
    """This rank's new contents of the slots it receives in `moves`, read from `weights` (each
    [slots_per_rank, ...]) and from the other ranks, without changing `weights`.

    Every rank of the group must call it with the same `moves` (it exchanges with them).
    `group` is the torch.distributed group for the transfers and `group_ranks` its global ranks
    (index = EP rank); both None for one rank.
    """
    base = rank * slots_per_rank
    mine = [m for m in moves if m.dst // slots_per_rank == rank]
    device = weights[0].device if weights else torch.device("cpu")
    local_slots = torch.tensor([m.dst - base for m in mine], dtype=torch.int64, device=device)
    buffers = [
        torch.empty((len(mine), *w.shape[1:]), dtype=w.dtype, device=w.device) for w in weights
    ]
    row_of = {m.dst: row for row, m in enumerate(mine)}
    ops: list[dist.P2POp] = []
    for index, move in enumerate(moves):
        src_rank, dst_rank = move.src // slots_per_rank, move.dst // slots_per_rank
        if src_rank == dst_rank:
            continue
        peer = dst_rank if src_rank == rank else src_rank
        if rank not in (src_rank, dst_rank):
            continue
        if group_ranks is None:
            raise ValueError("moves between ranks need the EPLB group's ranks")
        for w_index, w in enumerate(weights):
            tag = index * len(weights) + w_index
            if src_rank == rank:
                ops.append(
                    dist.P2POp(
                        dist.isend, w[move.src - base].contiguous(), group_ranks[peer], group, tag
                    )
                )
            else:
                ops.append(
                    dist.P2POp(
                        dist.irecv,
                        buffers[w_index][row_of[move.dst]],
                        group_ranks[peer],
                        group,
                        tag,
                    )
                )
    for row, move in enumerate(mine):
        if move.src // slots_per_rank == rank:
            for w, buf in zip(weights, buffers, strict=True):
                buf[row].copy_(w[move.src - base])
    if ops:
        for request in dist.batch_isend_irecv(ops):
            request.wait()
    return StagedLayer(local_slots, buffers)


def commit_layer(weights: Sequence[torch.Tensor], staged: StagedLayer) -> None:
    """Write the staged slots into `weights` in place."""
    if staged.local_slots.numel() == 0:
        return
    for w, buf in zip(weights, staged.buffers, strict=True):
        w.index_copy_(0, staged.local_slots, buf)
