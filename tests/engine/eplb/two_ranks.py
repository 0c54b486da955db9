"""One rank of the 2-process EPLB runs (`python -m tests.engine.eplb.two_ranks RANK PORT OUT`).

Both ranks build the same stand-in MoE layers (EP = 2, gloo), route a skewed load through them
step by step, and write what they saw to OUT/rank<RANK>.json: per step whether load was
recorded, whether the output equalled the dense reference, the maps and weights after each
commit, and the measured balancedness. One run covers the sync and the async mode.
"""

from __future__ import annotations

import json
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from fleetserve.engine.eplb.state import EplbGroup, EplbSettings, EplbState
from tests.engine.eplb.standin import StandInMoE, logical_weights, reference, skewed_ids

NUM_LOGICAL, NUM_REDUNDANT, DIM, TOP_K, TOKENS = 8, 2, 8, 2, 24
INTERVAL, WINDOW, STEPS = 6, 3, 16


def run_mode(
    use_async: bool, rank: int, forward_group: Any, eplb_group: EplbGroup
) -> dict[str, Any]:
    layers = [
        StandInMoE(
            NUM_LOGICAL,
            NUM_REDUNDANT,
            DIM,
            ep_size=2,
            ep_rank=rank,
            seed=layer,
            group=forward_group,
        )
        for layer in range(2)
    ]
    settings = EplbSettings(window_size=WINDOW, step_interval=INTERVAL, use_async=use_async)
    state = EplbState(layers, settings, eplb_group)
    steps: list[dict[str, Any]] = []
    commits: list[int] = []
    measured: list[float | None] = []
    for step in range(1, STEPS + 1):
        recorded = [layer.expert_load is not None for layer in layers]
        exact = True
        for index, layer in enumerate(layers):
            # Experts 2 and 3 (both on rank 0 at load) take most of layer 0's tokens; 6 and 7
            # (rank 1) most of layer 1's.
            ids = skewed_ids(TOKENS, TOP_K, NUM_LOGICAL, hot=2 + 4 * index, seed=step)
            x = torch.randn(
                TOKENS, DIM, generator=torch.Generator().manual_seed(step), dtype=torch.float64
            )
            out = layer(x, ids)
            want = reference(x, ids, logical_weights(NUM_LOGICAL, DIM, index))
            exact = exact and torch.allclose(out, want, rtol=1e-12, atol=1e-12)
        before = state.stats.rebalances
        state.after_step()
        if state.stats.rebalances > before:
            commits.append(step)
        if step % INTERVAL == 0:
            measured.append(state.stats.balancedness)
        steps.append({"recorded": recorded, "exact": exact, "pending": state.pending})
    weights_ok = []
    for index, layer in enumerate(layers):
        k = layer.num_local_physical_experts
        local = state.maps.physical_to_logical[index, rank * k : (rank + 1) * k]
        weights_ok.append(
            torch.equal(layer.weight, logical_weights(NUM_LOGICAL, DIM, index)[local])
        )
    return {
        "steps": steps,
        "commits": commits,
        "measured": measured,
        "p2l": state.maps.physical_to_logical.tolist(),
        "weights_ok": weights_ok,
        "stats": vars(state.stats),
    }


def run_failing_async(rank: int, forward_group: Any, eplb_group: EplbGroup) -> dict[str, Any]:
    """Async staging fails on rank 1 only: every rank must raise, on the same step."""
    layers = [StandInMoE(NUM_LOGICAL, NUM_REDUNDANT, DIM, ep_size=2, ep_rank=rank, seed=0,
                         group=forward_group)]  # fmt: skip
    settings = EplbSettings(window_size=WINDOW, step_interval=INTERVAL, use_async=True)
    state = EplbState(layers, settings, eplb_group)
    if rank == 1:

        def broken(new: Any) -> Any:
            raise OSError("staging failed")

        state._stage = broken  # type: ignore[method-assign]
    for step in range(1, STEPS + 1):
        ids = skewed_ids(TOKENS, TOP_K, NUM_LOGICAL, hot=2, seed=step)
        layers[0](torch.randn(TOKENS, DIM, dtype=torch.float64), ids)
        try:
            state.after_step()
        except RuntimeError as exc:
            return {"raised_at": step, "error": str(exc), "rebalances": state.stats.rebalances}
    return {"raised_at": None}


def main() -> None:
    rank, port, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=2,
        timeout=timedelta(seconds=60),
    )
    forward_group = dist.new_group([0, 1], backend="gloo")
    eplb_group = EplbGroup.create([[0, 1]], rank, "gloo")
    result = {
        mode: run_mode(mode == "async", rank, forward_group, eplb_group)
        for mode in ("sync", "async")
    }
    result["failing"] = run_failing_async(rank, forward_group, eplb_group)
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
