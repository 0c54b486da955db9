"""Building a KV connector's two roles from the engine configuration."""

from __future__ import annotations

import dataclasses
from typing import Any

import fleetserve
from fleetserve.engine.config import EngineConfig
from fleetserve.engine.kv_transfer.compat import compatibility_hash, compatibility_key
from fleetserve.engine.kv_transfer.head_map import KVLayout
from fleetserve.engine.kv_transfer.rank_group import RankGroup, SingleRank
from fleetserve.engine.kv_transfer.scheduler_role import EngineIdentity, P2PConnectorScheduler
from fleetserve.engine.kv_transfer.transport import TcpConfig, make_transport
from fleetserve.engine.kv_transfer.worker_role import P2PConnectorWorker, new_engine_id

__all__ = ["create_scheduler_role", "create_worker_role"]


def kv_layout(config: EngineConfig) -> KVLayout:
    """The engine's KV layout, as its connector's handshake describes it."""
    from fleetserve.engine.models.arch import ModelArch

    arch = ModelArch.from_hf_config(config.model.hf_config)
    return KVLayout(
        tp_size=config.parallel.tensor_parallel_size,
        pp_size=config.parallel.pipeline_parallel_size,
        num_kv_heads=arch.num_key_value_heads,
        head_size=arch.head_size,
        block_size=config.cache.block_size,
    )


def create_worker_role(config: EngineConfig, ranks: RankGroup | None = None) -> P2PConnectorWorker:
    """The worker role of this engine's connector (one per rank); `ranks` is the engine's
    tensor-parallel group (None: one rank).

    A fixed `side_channel_port` is rank 0's (the one peers are told); rank r binds port + r.

    Raises:
        ValueError: the engine has no `kv_transfer` configuration.
    """
    kv = config.kv_transfer
    if kv is None:
        raise ValueError("create_worker_role needs an engine with kv_transfer_config")
    ranks = ranks if ranks is not None else SingleRank()
    if kv.side_channel_port and ranks.rank:
        kv = dataclasses.replace(kv, side_channel_port=kv.side_channel_port + ranks.rank)
    engine_id = new_engine_id()
    options: dict[str, Any]
    if kv.connector == "tcp":
        options = {
            "host": kv.host,
            "config": TcpConfig(
                lanes_per_peer=min(4, kv.num_threads),
                connect_timeout=kv.handshake_timeout_s,
                transfer_timeout=kv.transfer_timeout_s,
            ),
        }
    else:
        options = {
            "host": kv.host,
            "protocol": kv.protocol,
            "workers": min(2, kv.num_threads),
            "transfer_timeout": kv.transfer_timeout_s,
        }
    transport = make_transport(kv.connector, engine_id, **options)
    return P2PConnectorWorker(
        kv,
        engine_id=engine_id,
        compatibility_hash=compatibility_hash(config, fleetserve.__version__),
        compatibility_key=compatibility_key(config, fleetserve.__version__),
        block_size=config.cache.block_size,
        transport=transport,
        layout=kv_layout(config),
        ranks=ranks,
    )


def create_scheduler_role(config: EngineConfig, identity: EngineIdentity) -> P2PConnectorScheduler:
    """The scheduler role, told the workers' identity (what producers' responses name)."""
    kv = config.kv_transfer
    if kv is None:
        raise ValueError("create_scheduler_role needs an engine with kv_transfer_config")
    return P2PConnectorScheduler(kv, config.cache.block_size, identity)
