"""Building a KV connector's two roles from the engine configuration."""

from __future__ import annotations

from typing import Any

import fleetserve
from fleetserve.engine.config import EngineConfig
from fleetserve.engine.kv_transfer.compat import compatibility_hash, compatibility_key
from fleetserve.engine.kv_transfer.scheduler_role import EngineIdentity, P2PConnectorScheduler
from fleetserve.engine.kv_transfer.transport import TcpConfig, make_transport
from fleetserve.engine.kv_transfer.worker_role import P2PConnectorWorker, new_engine_id

__all__ = ["create_scheduler_role", "create_worker_role"]


def create_worker_role(config: EngineConfig) -> P2PConnectorWorker:
    """The worker role of this engine's connector (one per rank).

    Raises:
        ValueError: the engine has no `kv_transfer` configuration.
    """
    kv = config.kv_transfer
    if kv is None:
        raise ValueError("create_worker_role needs an engine with kv_transfer_config")
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
    )


def create_scheduler_role(config: EngineConfig, identity: EngineIdentity) -> P2PConnectorScheduler:
    """The scheduler role, told the workers' identity (what producers' responses name)."""
    kv = config.kv_transfer
    if kv is None:
        raise ValueError("create_scheduler_role needs an engine with kv_transfer_config")
    return P2PConnectorScheduler(kv, config.cache.block_size, identity)
