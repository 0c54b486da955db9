"""Engine command line, env and rendered config of one role, from the typed topology."""

from __future__ import annotations

import json
from typing import Any

from fleetserve.api.models import InferenceDeploymentSpec, Role
from fleetserve.api.topology import rank_layout

__all__ = ["ENGINE_PORT", "MODEL_MOUNT", "engine_args", "engine_config", "engine_env", "model_path"]

ENGINE_PORT = 8000
MODEL_MOUNT = "/model"


def model_path(uri: str) -> str:
    """Where the engine reads the model: under the read-only mount for pvc/hostpath, else as is.

    Raises:
        ValueError: an unsupported URI scheme.
    """
    if uri.startswith(("pvc://", "hostpath://")):
        rest = uri.split("://", 1)[1]
        sub = rest.split("/", 1)[1] if uri.startswith("pvc://") and "/" in rest else ""
        return f"{MODEL_MOUNT}/{sub}".rstrip("/")
    if uri.startswith("/"):
        return uri
    raise ValueError(
        f"model.source.uri must be pvc://, hostpath:// or an absolute path, got {uri!r}"
    )


def kv_transfer_config(spec: InferenceDeploymentSpec, role_name: str) -> dict[str, Any] | None:
    """The `--kv-transfer-config` JSON object of a role (None without a connector)."""
    kv = spec.kv_transfer
    if kv.connector == "none":
        return None
    return {
        "connector": kv.connector,
        "role": "producer" if role_name == "prefill" else "consumer",
        "protocol": kv.protocol,
        "lease_seconds": kv.lease_seconds,
        "load_failure_policy": kv.load_failure_policy,
    }


def engine_args(spec: InferenceDeploymentSpec, role_name: str, role: Role) -> list[str]:
    """`fleetserve serve` arguments (flags the engine CLI accepts), user `engine.args` last."""
    p = role.parallelism
    args = [
        "serve",
        model_path(spec.model.source.uri),
        "--served-model-name",
        spec.model.name,
        "--dtype",
        spec.model.dtype,
        "--block-size",
        str(spec.model.block_size),
        "--tensor-parallel-size",
        str(p.tensor),
        "--pipeline-parallel-size",
        str(p.pipeline),
        # NOTE: bind the pod IP, not 0.0.0.0: on the dev cluster's local node pods share the host
        # network, each with its own loopback address.
        "--host",
        "$(FLEETSERVE_POD_IP)",
        "--port",
        str(ENGINE_PORT),
    ]
    if spec.model.max_model_len is not None:
        args += ["--max-model-len", str(spec.model.max_model_len)]
    if p.expert:
        args.append("--enable-expert-parallel")
    if role.eplb.enabled:
        args.append("--enable-eplb")
    kv = kv_transfer_config(spec, role_name)
    if kv is not None:
        args += ["--kv-transfer-config", json.dumps(kv, sort_keys=True, separators=(",", ":"))]
    for flag, value in sorted(spec.engine.args.items()):
        args += [f"--{flag}"] + ([value] if value else [])
    return args


def engine_env(
    spec: InferenceDeploymentSpec, role_name: str, role: Role, leader: str
) -> list[dict[str, Any]]:
    """Env of every pod in a group; the pod's rank comes from its StatefulSet pod index.

    # NOTE: the engine has no multi-pod flags yet, so ranks and the leader go through env vars.
    """
    p = role.parallelism
    world = p.tensor * p.pipeline
    index_ref = {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}
    env: list[dict[str, Any]] = [
        {"name": "FLEETSERVE_POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {"name": "FLEETSERVE_ROLE", "value": role_name},
        {"name": "FLEETSERVE_RANK", "valueFrom": index_ref},
        {"name": "FLEETSERVE_GROUP_SIZE", "value": str(role.group_size)},
        {"name": "FLEETSERVE_WORLD_SIZE", "value": str(world)},
        {"name": "FLEETSERVE_GPUS_PER_POD", "value": str(role.gpus_per_pod)},
        {"name": "FLEETSERVE_LEADER_ADDRESS", "value": leader},
        {"name": "FLEETSERVE_TP_SIZE", "value": str(p.tensor)},
        {"name": "FLEETSERVE_PP_SIZE", "value": str(p.pipeline)},
        {"name": "FLEETSERVE_DP_SIZE", "value": str(p.data)},
        {"name": "FLEETSERVE_EP_SIZE", "value": str(p.tensor * p.data if p.expert else 1)},
        {"name": "FLEETSERVE_SERVED_MODEL_NAME", "value": spec.model.name},
        {"name": "FLEETSERVE_CONFIG", "value": "/etc/fleetserve/engine.json"},
    ]
    if role.eplb.enabled:
        e = role.eplb
        env += [
            {"name": "FLEETSERVE_EPLB_REDUNDANT_EXPERTS", "value": str(e.redundant_experts)},
            {"name": "FLEETSERVE_EPLB_WINDOW_SIZE", "value": str(e.window_size)},
            {"name": "FLEETSERVE_EPLB_STEP_INTERVAL", "value": str(e.step_interval)},
            {"name": "FLEETSERVE_EPLB_POLICY", "value": e.policy},
        ]
    env += [{"name": k, "value": v} for k, v in sorted(spec.engine.env.items())]
    return env


def engine_config(spec: InferenceDeploymentSpec) -> dict[str, Any]:
    """The rendered engine config of every role (the ConfigMap's `engine.json`)."""
    roles: dict[str, Any] = {}
    for name, role in spec.roles.items():
        p = role.parallelism
        layout = rank_layout(
            p.tensor * p.pipeline, tensor=p.tensor, pipeline=p.pipeline, expert=p.expert
        )
        per_pod = role.gpus_per_pod or 1
        roles[name] = {
            "args": engine_args(spec, name, role),
            "group_size": role.group_size,
            "ranks_per_pod": [
                list(range(i * per_pod, min((i + 1) * per_pod, layout.world_size)))
                for i in range(role.group_size)
            ],
            "tensor_groups": layout.tensor,
            "pipeline_groups": layout.pipeline,
            "expert_groups": layout.expert,
            "eplb": role.eplb.model_dump(by_alias=True),
            "kv_transfer": kv_transfer_config(spec, name),
        }
    return {"model": spec.model.model_dump(by_alias=True), "roles": roles}
