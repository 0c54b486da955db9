"""The group plan of one role: which replica groups to create, drain, undrain and delete.

Pure: the reconcile (`fleetserve.operator.reconcile`) reads the live groups, asks
`fleetserve.operator.drain` whether each draining group is done, and carries out the plan.

A group is *current* when its StatefulSet carries the template the spec renders now, *stale*
otherwise; it is *active* unless it is draining. The plan converges on `replicas` active
current groups without ever taking a ready group away while that would leave fewer than
`replicas` ready ones:

- Too few active groups (a scale-up): draining groups come back first (current before stale,
  ready before not), then new groups are created; a scale-up is not bounded by the surge.
- Stale groups (a roll): new current groups are surged while the role's live groups, draining
  ones included (they still hold their GPUs), number fewer than `replicas + max_surge`. A stale
  group is drained once the role keeps `replicas` active groups without it and, if it is
  ready, `replicas` ready ones; not-ready stale groups go first. With `hold_roll` (another
  role's new groups are not ready yet) no stale group is drained, so the roles' revisions
  change together and every prefill group keeps a decode group of its revision to pair with.
- Too many current groups (a scale-down): the surplus is drained, not-ready groups first, then
  the highest indices.
- Draining groups that are done (nothing in flight) or past their timeout are deleted.

New groups take the lowest indices no live group uses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

__all__ = ["DrainReason", "GroupView", "RolePlan", "plan_role"]

DrainReason = Literal["scale-down", "roll"]


@dataclass(frozen=True, slots=True)
class GroupView:
    """One live group of a role, as the plan sees it."""

    index: int
    current: bool
    """Its template is the one the spec renders now."""
    ready: bool
    draining: bool = False
    done: bool = False
    """Draining, and its drain finished (nothing in flight) or timed out: it may be deleted."""


@dataclass(frozen=True, slots=True)
class RolePlan:
    """What one pass does to a role's groups (indices)."""

    create: tuple[int, ...] = ()
    drain: tuple[tuple[int, DrainReason], ...] = ()
    undrain: tuple[int, ...] = ()
    delete: tuple[int, ...] = ()

    @property
    def empty(self) -> bool:
        return not (self.create or self.drain or self.undrain or self.delete)


def plan_role(
    groups: Sequence[GroupView], replicas: int, max_surge: int, *, hold_roll: bool = False
) -> RolePlan:
    """The next step for one role (see the module docstring).

    Raises:
        ValueError: `replicas` < 0, `max_surge` < 1, or two groups share an index.
    """
    if replicas < 0:
        raise ValueError(f"replicas must be >= 0, got {replicas}")
    if max_surge < 1:
        raise ValueError(f"max_surge must be >= 1, got {max_surge}")
    if len({g.index for g in groups}) != len(groups):
        raise ValueError(f"group indices must be unique, got {sorted(g.index for g in groups)}")
    active = [g for g in groups if not g.draining]
    draining = [g for g in groups if g.draining]

    # A scale-up cancels drains before it creates anything.
    comeback = sorted(draining, key=lambda g: (not g.current, not g.ready, g.index))
    undrain = comeback[: max(0, replicas - len(active))]
    active += undrain
    draining = [g for g in draining if g not in undrain]
    delete = [g.index for g in draining if g.done]
    still_draining = len(draining) - len(delete)

    current = [g for g in active if g.current]
    stale = [g for g in active if not g.current]
    scale_up = max(0, replicas - len(active))
    missing_current = max(0, replicas - len(current) - scale_up)
    room = replicas + max_surge - (len(active) + scale_up + still_draining)
    surge = max(0, min(missing_current, room))
    create_n = scale_up + surge

    drain: list[tuple[int, DrainReason]] = []
    surplus = sorted(current, key=lambda g: (g.ready, -g.index))[: max(0, len(current) - replicas)]
    drain += [(g.index, "scale-down") for g in surplus]
    kept_current = [g for g in current if g not in surplus]
    active_n = len(kept_current) + len(stale) + create_n
    ready_n = sum(g.ready for g in kept_current) + sum(g.ready for g in stale)
    if not hold_roll:
        for g in sorted(stale, key=lambda g: (g.ready, -g.index)):
            if active_n - 1 < replicas or (g.ready and ready_n - 1 < replicas):
                continue
            drain.append((g.index, "roll"))
            active_n -= 1
            ready_n -= g.ready

    used = {g.index for g in groups}
    free = (i for i in range(len(used) + create_n + 1) if i not in used)
    create = tuple(next(free) for _ in range(create_n))
    return RolePlan(
        create=create,
        drain=tuple(drain),
        undrain=tuple(g.index for g in undrain),
        delete=tuple(delete),
    )
