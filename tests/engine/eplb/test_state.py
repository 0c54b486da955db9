"""One EP rank's cycle (no processes): what is recorded when, what a rebalance with nothing to
gain does, and the settings' validation."""

from __future__ import annotations

import pytest
import torch

from fleetserve.engine.eplb.rearrange import Move, commit_layer, plan_moves, stage_layer
from fleetserve.engine.eplb.state import EplbSettings, EplbState
from tests.engine.eplb.standin import StandInMoE, logical_weights


def test_load_counts_exactly_the_window_steps_and_nothing_else() -> None:
    layer = StandInMoE(4, 2, 8)
    state = EplbState([layer], EplbSettings(window_size=2, step_interval=5))
    x = torch.randn(3, 8, dtype=torch.float64)
    seen = []
    for step in range(1, 5):
        seen.append(layer.expert_load is not None)
        # Steps outside the window route to expert 0; window steps (4, 5) to expert `step % 4`.
        ids = torch.full((3, 1), 0 if step < 4 else step % 4)
        layer(x, ids)
        state.after_step()
    assert seen == [False, False, False, True]
    load = layer.expert_load
    assert load is not None
    # Step 4 routed 3 tokens to expert 0, whose replicas are slots 0 and 4 (round robin).
    assert load.tolist() == [2, 0, 0, 0, 1, 0]
    layer(x, torch.full((3, 1), 1))
    state.after_step()  # step 5: the rebalance; one rank has nothing to balance: skipped
    assert state.stats.skipped == 1 and state.stats.rebalances == 0
    assert state.stats.balancedness == 1.0 and state.stats.steps == 5
    assert layer.expert_load is None  # step 6 is outside the next window again


def test_plan_moves_prefers_local_copies() -> None:
    # 2 ranks x 3 slots. Slot 1 (rank 0) needs expert 5: only on rank 1 (slot 5) → a transfer;
    # slot 4 (rank 1) needs expert 3, which rank 1 holds in slot 3 → a local copy.
    old = [0, 1, 2, 3, 4, 5]
    new = [0, 5, 2, 3, 3, 1]
    assert plan_moves(old, new, 3) == [Move(src=5, dst=1), Move(src=3, dst=4), Move(src=1, dst=5)]
    with pytest.raises(ValueError, match="logical expert 9"):
        plan_moves(old, [9, 1, 2, 3, 4, 5], 3)


def test_local_rearrangement_writes_what_the_new_map_says() -> None:
    layer = StandInMoE(4, 2, 8)
    weights = logical_weights(4, 8, 0)
    new = [3, 3, 1, 0, 2, 1]
    moves = plan_moves(layer.physical_to_logical, new, 6)
    storage = layer.weight.data_ptr()
    commit_layer(
        layer.expert_weights(), stage_layer(layer.expert_weights(), moves, rank=0, slots_per_rank=6)
    )
    assert torch.equal(layer.weight, weights[new])
    assert layer.weight.data_ptr() == storage  # in place


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"window_size": 0}, "window_size"),
        ({"policy": "best"}, "policy"),
        ({"num_nodes": 0}, "num_nodes"),
    ],
)
def test_bad_settings_are_refused_by_name(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        EplbSettings(**kwargs)  # type: ignore[arg-type]
