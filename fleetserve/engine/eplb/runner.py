"""EPLB in the model runner: built after the model loads, counted after every forward.

`create_eplb_state` gives each rank the `EplbState` of its MoE layers (None when EPLB is off),
creating the EP group's own EPLB process groups collectively (every rank of the world calls it
when it loads its model, in the same order). `eplb_step` is the one call the runner makes per
forward; it returns the counts to report when they changed (the driver rank's reach
`/metrics`).
"""

from __future__ import annotations

from dataclasses import replace

import torch.distributed as dist
from torch import nn

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.eplb.state import EplbGroup, EplbSettings, EplbState, MoELayer
from fleetserve.engine.eplb.stats import EplbStats
from fleetserve.engine.layers.layer_context import LayerContext

__all__ = ["create_eplb_state", "eplb_step"]


def create_eplb_state(
    config: EngineConfig, model: nn.Module, context: LayerContext
) -> EplbState | None:
    """This rank's EPLB over `model.moe_layers()` (None unless `config.eplb.enabled`, or for a
    pipeline stage without MoE layers: `EngineArgs` refuses EPLB for dense models)."""
    if not config.eplb.enabled:
        return None
    group = None
    if context.ep_group is not None and context.ep_size > 1:
        from fleetserve.engine.distributed.parallel_state import device_backend, layout_of

        # NOTE: before anything can return: every rank creates every EP group's groups.
        backend = device_backend(context.device)
        group = EplbGroup.create(layout_of(config.parallel).expert, dist.get_rank(), backend)
    moe_layers = getattr(model, "moe_layers", None)
    layers: list[MoELayer] = list(moe_layers()) if callable(moe_layers) else []
    if not layers:
        return None
    e = config.eplb
    first = layers[0]
    settings = EplbSettings(
        window_size=e.window_size,
        step_interval=e.step_interval,
        policy=e.policy,
        use_async=e.use_async,
        num_groups=int(getattr(getattr(first, "routing", None), "num_expert_groups", 1) or 1),
        # NOTE: MoE models run eagerly (the worker does not capture them: expert segment
        # sizes are read on the host), so `expert_load` can be detached outside the window; a
        # captured graph would need `keep_load_attached=True`.
        keep_load_attached=False,
    )
    return EplbState(layers, settings, group)


def eplb_step(state: EplbState) -> EplbStats | None:
    """Count one forward; the counts (a copy) when a rebalance or commit changed them."""
    return replace(state.stats) if state.after_step() else None
