"""Engine command line and env of one role, from the typed topology (pure).

Flags carry the names of the engine's single argument definition (`fleetserve serve`); env
variables are those `fleetserve.envs.Env` declares, named with `env_name()`, plus Mooncake's own
`MC_*` knobs (`transfer_env`), so everything rendered here is read by the engine or its transport.
"""

from __future__ import annotations

import json
from typing import Any

from fleetserve.api.labels import LABEL_POD_INDEX
from fleetserve.api.models import InferenceDeploymentSpec, Role
from fleetserve.envs import env_name

__all__ = [
    "ENGINE_FLAGS",
    "ENGINE_PORT",
    "MODEL_MOUNT",
    "engine_args",
    "engine_env",
    "kv_transfer_config",
    "model_path",
    "transfer_env",
]

ENGINE_PORT = 8000
MODEL_MOUNT = "/model"

ENGINE_FLAGS = (
    "--served-model-name",
    "--dtype",
    "--block-size",
    "--host",
    "--port",
    "--max-model-len",
    "--tensor-parallel-size",
    "--pipeline-parallel-size",
    "--data-parallel-size",
    "--enable-expert-parallel",
    "--enable-eplb",
    "--num-redundant-experts",
    "--eplb-window-size",
    "--eplb-step-interval",
    "--eplb-policy",
    "--eplb-use-async",
    "--kv-transfer-config",
    "--quantization",
    "--enable-lora",
    "--max-loras",
    "--max-cpu-loras",
    "--max-lora-rank",
    "--lora-modules",
)
"""Every `fleetserve serve` flag `engine_args` can render (besides the user's `engine.args`)."""


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


def adapter_path(model_uri: str, adapter_uri: str) -> str:
    """Where an engine pod reads a LoRA adapter: on the model's own volume (the pod mounts
    only that one), or a path inside the image.

    Raises:
        ValueError: another scheme, another claim than the model's, or a hostpath outside the
            model's.
    """
    if adapter_uri.startswith("/"):
        return adapter_uri
    for scheme in ("pvc://", "hostpath://"):
        if adapter_uri.startswith(scheme) and model_uri.startswith(scheme):
            model_rest, rest = model_uri[len(scheme) :], adapter_uri[len(scheme) :]
            if scheme == "pvc://":
                claim, model_claim = rest.split("/", 1)[0], model_rest.split("/", 1)[0]
                if claim == model_claim and "/" in rest:
                    return f"{MODEL_MOUNT}/{rest.split('/', 1)[1]}".rstrip("/")
            elif rest.startswith(model_rest.rstrip("/") + "/"):
                return f"{MODEL_MOUNT}/{rest[len(model_rest.rstrip('/')) + 1 :]}"
    raise ValueError(
        f"model.lora.adapters uri {adapter_uri!r} must be on the model's volume ({model_uri}: "
        "the same pvc claim, or under its hostpath) or an absolute path inside the image"
    )


def lora_args(spec: InferenceDeploymentSpec) -> list[str]:
    """`--enable-lora` and its settings when the model lists adapters (every role serves them:
    a prefill leg computes the prompt under the same adapter as its decode leg).

    Raises:
        ValueError: an adapter the pods cannot reach (`adapter_path`).
    """
    lora = spec.model.lora
    if lora is None:
        return []
    args = ["--enable-lora", "--max-loras", str(lora.max_loras)]
    if lora.max_cpu_loras is not None:
        args += ["--max-cpu-loras", str(lora.max_cpu_loras)]
    args += ["--max-lora-rank", str(lora.max_lora_rank)]
    if lora.adapters:
        args.append("--lora-modules")
        args += [f"{a.name}={adapter_path(spec.model.source.uri, a.uri)}" for a in lora.adapters]
    return args


def kv_transfer_config(spec: InferenceDeploymentSpec, role_name: str) -> dict[str, Any] | None:
    """The `--kv-transfer-config` JSON object of a role (None without a connector).

    Keys are the engine's `KVTransferConfig` fields: the api's `KVTransfer` fields in snake_case
    (less `rdma_resource`, which is the pod's, not the engine's), the connector role (prefill
    produces KV, decode consumes it) and the address peers reach the connector at: the pod IP.
    """
    kv = spec.kv_transfer
    if kv.connector == "none":
        return None
    return {
        "connector": kv.connector,
        "role": "producer" if role_name == "prefill" else "consumer",
        "protocol": kv.protocol,
        "transfer_mode": kv.transfer_mode,
        "lease_seconds": kv.lease_seconds,
        "load_failure_policy": kv.load_failure_policy,
        "num_threads": kv.num_threads,
        "host": f"$({env_name('pod_ip')})",
    }


def transfer_env(spec: InferenceDeploymentSpec) -> list[dict[str, Any]]:
    """Communication env of the KV transport, the same on every pod of every role.

    A role argument is deliberately absent: both peers of a pair must agree on these (seed part 2
    §2.8). Mooncake reads its `MC_*` variables once, as its extension loads, so they are set on
    the container rather than by the engine: bind its TCP transport to the pod IP (pods on the
    dev cluster's local node share the host network, each with its own loopback address) and cap
    its worker threads per context at `numThreads`.
    """
    kv = spec.kv_transfer
    if kv.connector != "mooncake":
        return []
    return [
        {"name": "MC_TCP_BIND_ADDRESS", "value": f"$({env_name('pod_ip')})"},
        {"name": "MC_WORKERS_PER_CTX", "value": str(kv.num_threads)},
    ]


def engine_args(spec: InferenceDeploymentSpec, role_name: str, role: Role) -> list[str]:
    """`fleetserve serve` arguments (flags the engine CLI accepts), user `engine.args` last.

    Parallel sizes are rendered when above 1 (the engine's default), so a single-rank engine's
    command line carries no parallel flag; EPLB's settings only with EPLB on.

    Raises:
        ValueError: an unsupported model URI.
    """
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
        # NOTE: bind the pod IP, not 0.0.0.0: on the dev cluster's local node pods share the host
        # network, each with its own loopback address.
        "--host",
        f"$({env_name('pod_ip')})",
        "--port",
        str(ENGINE_PORT),
    ]
    if spec.model.max_model_len is not None:
        args += ["--max-model-len", str(spec.model.max_model_len)]
    if spec.model.quantization is not None:
        args += ["--quantization", spec.model.quantization]
    for flag, size in (
        ("--tensor-parallel-size", p.tensor),
        ("--pipeline-parallel-size", p.pipeline),
        ("--data-parallel-size", p.data),
    ):
        if size > 1:
            args += [flag, str(size)]
    if p.expert:
        args.append("--enable-expert-parallel")
    if role.eplb.enabled:
        e = role.eplb
        args += [
            "--enable-eplb",
            "--num-redundant-experts",
            str(e.redundant_experts),
            "--eplb-window-size",
            str(e.window_size),
            "--eplb-step-interval",
            str(e.step_interval),
            "--eplb-policy",
            e.policy,
        ]
        if e.use_async:
            args.append("--eplb-use-async")
    kv = kv_transfer_config(spec, role_name)
    if kv is not None:
        args += ["--kv-transfer-config", json.dumps(kv, sort_keys=True, separators=(",", ":"))]
    args += lora_args(spec)
    for flag, value in sorted(spec.engine.args.items()):
        args += [f"--{flag}"] + ([value] if value else [])
    return args


def engine_env(spec: InferenceDeploymentSpec, role: Role, leader: str) -> list[dict[str, Any]]:
    """Env of every pod in a group (the transport's last), then the user's `engine.env`.

    The pod's rank is its StatefulSet pod index (pod 0 leads); the world size counts every rank
    of the group (tensor × pipeline × data), the group size its pods, so each pod knows which
    ranks it runs (`fleetserve.engine.distributed.pod_group`).
    """
    env: list[dict[str, Any]] = [
        {"name": env_name("pod_ip"), "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
        {
            "name": env_name("rank"),
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{LABEL_POD_INDEX}']"}},
        },
        {"name": env_name("world_size"), "value": str(role.world_size)},
        {"name": env_name("group_size"), "value": str(role.group_size)},
        {"name": env_name("leader_address"), "value": leader},
        *transfer_env(spec),
    ]
    return env + [{"name": k, "value": v} for k, v in sorted(spec.engine.env.items())]
