"""The surge plan (`fleetserve.operator.roll.plan_role`), stepped through whole rolls and
scale changes: at no step does a role have fewer ready active groups than it had ready going in
(or than `replicas`, once it had that many), and live groups never exceed replicas + max surge
during a roll."""

from __future__ import annotations

import pytest

from fleetserve.operator.roll import GroupView, RolePlan, plan_role


def G(index: int, current: bool = True, ready: bool = True, draining: bool = False,
      done: bool = False) -> GroupView:  # fmt: skip
    return GroupView(index, current=current, ready=ready, draining=draining, done=done)


def test_steady_state_does_nothing() -> None:
    assert plan_role([G(0), G(1)], 2, 1).empty


def test_scale_up_creates_at_the_lowest_free_indices_unbounded_by_surge() -> None:
    assert plan_role([G(1)], 4, 1) == RolePlan(create=(0, 2, 3))


def test_scale_down_drains_unready_then_highest_index_and_deletes_only_when_done() -> None:
    assert plan_role([G(0), G(1), G(2, ready=False)], 1, 1).drain == (
        (2, "scale-down"),
        (1, "scale-down"),
    )
    draining = [G(0), G(1, draining=True), G(2, draining=True, done=True)]
    assert plan_role(draining, 1, 1) == RolePlan(delete=(2,))


def test_scale_up_during_a_drain_cancels_it_instead_of_creating() -> None:
    groups = [G(0), G(1, draining=True), G(2, current=False, draining=True)]
    assert plan_role(groups, 2, 1) == RolePlan(undrain=(1,))
    # Even a drain that is done comes back rather than a new group starting cold.
    assert plan_role([G(0), G(1, draining=True, done=True)], 2, 1) == RolePlan(undrain=(1,))
    # Beyond the draining groups, new ones.
    assert plan_role([G(0), G(1, draining=True)], 3, 1) == RolePlan(create=(2,), undrain=(1,))


def _apply(groups: list[GroupView], plan: RolePlan, *, ready_new: bool) -> list[GroupView]:
    """The cluster after a plan: new groups exist (ready once `ready_new`), drains are marked,
    and a draining group is done at the next step."""
    by = {g.index: g for g in groups if g.index not in plan.delete}
    for i in plan.undrain:
        by[i] = G(i, by[i].current, by[i].ready)
    for i, _ in plan.drain:
        by[i] = G(i, by[i].current, by[i].ready, draining=True)
    for i in plan.create:
        by[i] = G(i, ready=False)
    return [
        G(g.index, g.current, g.ready or ready_new, g.draining, done=g.draining)
        for g in by.values()
    ]


@pytest.mark.parametrize(("replicas", "surge"), [(1, 1), (2, 1), (3, 2), (4, 1)])
def test_a_roll_surges_before_it_drains_and_never_loses_a_ready_group(
    replicas: int, surge: int
) -> None:
    groups = [G(i, current=False) for i in range(replicas)]
    for step in range(60):
        plan = plan_role(groups, replicas, surge)
        if plan.empty and all(g.current and g.ready for g in groups):
            break
        live = len(groups) - len(plan.delete) + len(plan.create)
        assert live <= replicas + surge, (step, groups, plan)
        # New groups become ready only every third step: drains must wait for them.
        groups = _apply(groups, plan, ready_new=step % 3 == 2)
        serving = [g for g in groups if g.ready and not g.draining]
        assert len(serving) >= replicas, (step, groups)
    else:
        pytest.fail("the roll did not converge")
    assert sorted(g.index for g in groups) == sorted({g.index for g in groups})
    assert len(groups) == replicas
    assert all(g.current and g.ready and not g.draining for g in groups)


def test_a_roll_whose_new_group_never_becomes_ready_keeps_the_old_one_serving() -> None:
    groups = [G(0, current=False)]
    assert plan_role(groups, 1, 1) == RolePlan(create=(1,))
    stuck = [G(0, current=False), G(1, ready=False)]
    assert plan_role(stuck, 1, 1).empty


def test_a_broken_stale_group_is_drained_as_soon_as_its_replacement_exists() -> None:
    groups = [G(0, current=False, ready=False), G(1, current=False), G(2, ready=False)]
    assert plan_role(groups, 2, 1).drain == ((0, "roll"),)


def test_hold_roll_keeps_stale_groups_until_every_role_is_ready() -> None:
    groups = [G(0, current=False), G(1)]
    assert plan_role(groups, 1, 1).drain == ((0, "roll"),)
    assert plan_role(groups, 1, 1, hold_roll=True).empty


def test_draining_groups_use_the_surge_room() -> None:
    # 2 replicas, surge 1: one old group still drains, so the next surge waits for it.
    groups = [G(0, current=False), G(1, current=False, draining=True), G(2)]
    assert plan_role(groups, 2, 1).create == ()
    done = [G(0, current=False), G(1, current=False, draining=True, done=True), G(2)]
    # Its deletion frees the room in the same pass; the new group does not reuse the name of
    # one still being deleted.
    assert plan_role(done, 2, 1) == RolePlan(create=(3,), delete=(1,))


def test_scale_down_mid_roll_keeps_a_ready_group() -> None:
    groups = [G(0, current=False), G(1, current=False), G(2, ready=False)]
    assert plan_role(groups, 1, 1).drain == ((1, "roll"),)


def test_scale_to_zero_drains_everything() -> None:
    plan = plan_role([G(0), G(1, current=False)], 0, 1)
    assert sorted(plan.drain) == [(0, "scale-down"), (1, "roll")]


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"replicas": -1}, "replicas"), ({"max_surge": 0}, "max_surge")],
)
def test_bad_arguments_name_the_field(kwargs: dict[str, int], field: str) -> None:
    args = {"replicas": 1, "max_surge": 1, **kwargs}
    with pytest.raises(ValueError, match=field):
        plan_role([G(0)], args["replicas"], args["max_surge"])
    with pytest.raises(ValueError, match="unique"):
        plan_role([G(0), G(0)], 1, 1)
