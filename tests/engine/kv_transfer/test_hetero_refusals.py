"""What KV transfer between tensor-parallel engines does not support is refused by name: in the
engine's arguments, in the connectors' handshake (naming both layouts) and in the CRD."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from fleetserve.api.crd import crd_manifest
from fleetserve.api.models import InferenceDeploymentSpec
from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.config import KVTransferConfig
from fleetserve.engine.kv_transfer.head_map import KVLayout
from fleetserve.engine.kv_transfer.transport import TcpTransport
from fleetserve.engine.kv_transfer.worker_role import P2PConnectorWorker

KV = {"connector": "tcp", "role": "consumer"}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ({"pipeline_parallel_size": 2, "kv_transfer_config": KV}, "pipeline_parallel_size=2"),
        (
            {"tensor_parallel_size": 2, "kv_transfer_config": {**KV, "transfer_mode": "push"}},
            "transfer_mode 'push'.*needs transfer_mode 'pull'",
        ),
        (
            {
                "tensor_parallel_size": 2,
                "kv_transfer_config": {**KV, "connector": "mooncake", "transfer_mode": "push"},
            },
            "transfer_mode 'push'.*needs transfer_mode 'pull'",
        ),
    ],
)
def test_unsupported_parallel_kv_transfer_is_refused_by_name(
    args: dict[str, Any], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        EngineArgs(model="/nonexistent", **args).create_engine_config()


@pytest.mark.parametrize("connector", ["tcp", "mooncake"])
def test_tensor_parallel_pull_passes_the_refusal(connector: str) -> None:
    # The refusal is lifted: the next check to fail is the missing model folder.
    kv = {**KV, "connector": connector}
    with pytest.raises(ValueError, match="model must be a Hugging Face model folder"):
        EngineArgs(
            model="/nonexistent", tensor_parallel_size=2, kv_transfer_config=kv
        ).create_engine_config()


def _worker(layout: KVLayout, role: str) -> P2PConnectorWorker:
    config = KVTransferConfig(connector="tcp", role=role, handshake_timeout_s=5.0)
    worker = P2PConnectorWorker(
        config,
        engine_id=f"{role}-engine",
        compatibility_hash="same",
        compatibility_key={"model": "m"},
        block_size=layout.block_size,
        transport=TcpTransport(f"{role}-engine"),
        layout=layout,
    )
    shape = (2, 4, layout.block_size, layout.num_kv_heads, layout.head_size)
    worker.register_kv_caches([torch.zeros(shape)], layer_names=["layers.0.attn"])
    return worker


@pytest.fixture
def pp_producer() -> Iterator[P2PConnectorWorker]:
    # One rank of a producer that runs pipeline stages (a build that supports them, or a
    # misconfigured peer): this build cannot map its KV, and the handshake must say so.
    worker = _worker(KVLayout(1, 2, 4, 8, 16), "producer")
    yield worker
    worker.close()


def test_handshake_refuses_a_layout_it_cannot_map_naming_both(
    pp_producer: P2PConnectorWorker,
) -> None:
    consumer = _worker(KVLayout(1, 1, 4, 8, 16), "consumer")
    try:
        identity = pp_producer.identity()
        consumer._addresses[identity.engine_id] = (identity.host, identity.port)
        future = consumer.peers.connect(identity.engine_id)
        with pytest.raises(ValueError, match=r"pipeline_parallel_size 1 .*producer TP=1 PP=2") as e:
            future.result(timeout=10)
        assert "consumer TP=1 PP=1" in str(e.value)
    finally:
        consumer.close()


def _spec(connector: str, mode: str, prefill_tp: int, decode_tp: int) -> dict[str, Any]:
    def role(tp: int) -> dict[str, Any]:
        return {"gpusPerPod": tp, "parallelism": {"tensor": tp}}

    return {
        "model": {"name": "m", "source": {"uri": "/m"}, "dtype": "bfloat16"},
        "kvTransfer": {"connector": connector, "transferMode": mode},
        "roles": {"prefill": role(prefill_tp), "decode": role(decode_tp)},
    }


@pytest.mark.parametrize(
    ("connector", "mode", "prefill_tp", "decode_tp", "ok"),
    [
        ("tcp", "pull", 2, 1, True),
        ("tcp", "pull", 1, 2, True),
        ("tcp", "pull", 4, 4, True),
        ("tcp", "push", 1, 1, True),
        ("tcp", "push", 2, 2, False),
        ("mooncake", "pull", 1, 1, True),
        ("mooncake", "pull", 2, 1, True),
        ("mooncake", "push", 2, 2, False),
        ("mooncake", "push", 1, 2, False),
    ],
)
def test_crd_accepts_exactly_the_tensor_sizes_the_engine_supports(
    connector: str, mode: str, prefill_tp: int, decode_tp: int, ok: bool
) -> None:
    spec = _spec(connector, mode, prefill_tp, decode_tp)
    if ok:
        InferenceDeploymentSpec.model_validate(spec)
    else:
        with pytest.raises(ValidationError, match="transferMode pull"):
            InferenceDeploymentSpec.model_validate(spec)
    # The CEL rule that says the same on the API server is in the generated CRD.
    schema = crd_manifest()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    rules = schema["properties"]["spec"]["x-kubernetes-validations"]
    (rule,) = [r for r in rules if "transferMode pull" in r["message"]]
    assert "self.kvTransfer.transferMode == 'pull'" in rule["rule"]
    assert "connector" not in rule["rule"]
