"""Pydantic models of the InferenceDeployment spec and status (the CRD is generated from these).

Field names are snake_case in Python and camelCase on the wire (`by_alias=True`). Cross-field rules
live in `x-kubernetes-validations` (CEL) so the API server rejects bad specs before the operator sees
them; `InferenceDeploymentSpec.model_validator` repeats them for Python callers.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    WithJsonSchema,
    model_validator,
)
from pydantic.alias_generators import to_camel

from fleetserve.api.topology import group_size, world_size

__all__ = [
    "API_VERSION",
    "EPLB",
    "GROUP",
    "KIND",
    "PLURAL",
    "VERSION",
    "Autoscaling",
    "Condition",
    "DecodeScaling",
    "Disaggregation",
    "EngineSpec",
    "InferenceDeploymentSpec",
    "InferenceDeploymentStatus",
    "KVTransfer",
    "ModelSource",
    "ModelSpec",
    "Parallelism",
    "Phase",
    "PrefillScaling",
    "RatioBand",
    "Role",
    "RoleScaling",
    "RoleStatus",
    "Roles",
    "RouterSpec",
    "RouterStatus",
    "ScaleDecision",
    "ScaleDecisionRole",
    "Scheduling",
]

GROUP = "fleetserve.io"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceDeployment"
PLURAL = "inferencedeployments"


_DECIMAL = r"(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))"
QUANTITY_PATTERN = rf"^{_DECIMAL}(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?{_DECIMAL}))?$"
"""A non-negative Kubernetes resource quantity ("4", "500m", "2Gi", "1e3"): the API server's own
pattern for quantities without their sign, so that a typo is refused when the resource is
applied instead of when the operator's pods are created."""


def _check_quantity(value: str) -> str:
    if re.fullmatch(QUANTITY_PATTERN, value) is None:
        raise ValueError(
            "must be a Kubernetes quantity without a sign, such as '4', '500m' or '2Gi',"
            f" got {value!r}"
        )
    return value


Quantity = Annotated[
    str,
    AfterValidator(_check_quantity),
    WithJsonSchema({"type": "string", "pattern": QUANTITY_PATTERN}),
]
"""A resource quantity field: the pattern in the CRD (the API server refuses a mismatch with the
pattern in its message), the same check in Python with the allowed forms in words."""


def _cel(rule: str, message: str) -> dict[str, Any]:
    return {"x-kubernetes-validations": [{"rule": rule, "message": message}]}


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel, populate_by_name=True, extra="forbid", frozen=True
    )


class ModelSource(_Model):
    uri: str = Field(
        description="pvc://CLAIM/PATH, hostpath:///ABS/PATH, or /path/inside/the/image",
        min_length=1,
    )


class LoRAAdapter(_Model):
    name: str = Field(
        description="the model name clients send to use this adapter",
        min_length=1,
        max_length=256,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$",
    )
    uri: str = Field(
        description="the PEFT adapter folder: pvc://CLAIM/PATH on the model's claim, "
        "hostpath:///ABS/PATH under the model's hostpath, or /path/inside/the/image",
        min_length=1,
    )


class LoRASpec(_Model):
    """LoRA adapters every engine of the deployment serves beside the base model."""

    adapters: list[LoRAAdapter] = Field(default_factory=list, max_length=64)
    max_loras: int = Field(default=1, ge=1, description="adapters in device slots at once")
    max_cpu_loras: int | None = Field(
        default=None, ge=1, description="adapters cached in host memory (default: maxLoras)"
    )
    max_lora_rank: Literal[8, 16, 32, 64, 128, 256] = 16

    @model_validator(mode="after")
    def _check(self) -> LoRASpec:
        names = [a.name for a in self.adapters]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ValueError(f"model.lora.adapters: names must be unique, got {duplicates} twice")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"model.lora.maxCpuLoras must be >= maxLoras ({self.max_loras}), "
                f"got {self.max_cpu_loras}"
            )
        return self


class ModelSpec(_Model):
    name: str = Field(description="served model name clients use", min_length=1)
    source: ModelSource
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    max_model_len: int | None = Field(default=None, ge=1)
    moe: bool = Field(default=False, description="the architecture has MoE layers")
    block_size: int = Field(default=16, ge=1)
    quantization: (
        Literal[
            "int8", "int8_per_channel_weight_only", "fp8", "fp8_per_tensor", "compressed-tensors"
        ]
        | None
    ) = Field(
        default=None,
        description="quantized linear layers (`--quantization`): int8 weight-only or fp8 online, "
        "or compressed-tensors for a quantized checkpoint (unset: as the checkpoint is)",
    )
    lora: LoRASpec | None = Field(
        default=None, description="LoRA adapters served beside the base model (--enable-lora)"
    )


class EngineSpec(_Model):
    image: str = Field(default="fleetserve:latest", min_length=1)
    command: list[str] = Field(
        default_factory=lambda: ["fleetserve"], description="entry point (e.g. python -m)"
    )
    args: dict[str, str] = Field(
        default_factory=dict, description="extra `fleetserve serve` flags, name → value"
    )
    env: dict[str, str] = Field(default_factory=dict)
    cpu: Quantity = Field(default="4", description="CPU each engine pod requests")
    memory: Quantity = Field(
        default="32Gi", description="memory each engine pod requests, and its limit"
    )
    version: str = Field(default="0.1.0", description="engine version (in the KV hash)")


class KVTransfer(_Model):
    """How prefill pods hand their KV cache to decode pods (rendered into both roles' flags)."""

    model_config = ConfigDict(
        json_schema_extra=_cel(
            # NOTE: has(): the CRD validates its own default `{}` before any field default.
            "!has(self.protocol) || self.protocol != 'rdma' ||"
            " (has(self.connector) && self.connector == 'mooncake')",
            "protocol rdma needs the mooncake connector (tcp runs over TCP only)",
        )
    )

    connector: Literal["tcp", "mooncake", "none"] = "tcp"
    protocol: Literal["tcp", "rdma"] = Field(
        default="tcp", description="the mooncake connector's transport (rdma needs the NICs)"
    )
    transfer_mode: Literal["pull", "push"] = Field(
        default="pull",
        description="pull: decode reads the blocks; push: prefill writes them layer by layer",
    )
    lease_seconds: int = Field(
        default=30, ge=1, description="how long prefill keeps a prompt's blocks for decode"
    )
    load_failure_policy: Literal["recompute", "fail"] = Field(
        default="fail",
        description="fail: end the request with kv_transfer_failed; recompute: redo lost tokens",
    )
    num_threads: int = Field(
        default=4, ge=1, le=64, description="cap on transfer threads and lanes per pod"
    )
    rdma_resource: str = Field(
        default="rdma/hca",
        min_length=1,
        description="extended resource of the RDMA device plugin, requested when protocol is rdma",
    )


class Parallelism(_Model):
    tensor: int = Field(default=1, ge=1)
    pipeline: int = Field(default=1, ge=1)
    data: int = Field(default=1, ge=1)
    expert: bool = False


class EPLB(_Model):
    enabled: bool = False
    redundant_experts: int = Field(default=0, ge=0)
    window_size: int = Field(default=1000, ge=1)
    step_interval: int = Field(default=3000, ge=1)
    policy: Literal["hierarchical", "global"] = "global"
    use_async: bool = Field(
        default=False,
        description="move expert weights in the background and switch between steps",
    )


_RANKS = "self.parallelism.tensor * self.parallelism.pipeline * self.parallelism.data"


_EP_GROUP = "self.parallelism.tensor * self.parallelism.data"
_DATA_IN_ONE_POD = (
    "data > 1 runs every data-parallel rank in one pod behind its one server, with pipeline 1:"
    " tensor × pipeline × data must be <= gpusPerPod (spread over more pods with replicas,"
    " which the router balances)"
)
_DATA_UNIFIED = (
    "data > 1 needs a unified role: data parallel with KV transfer between prefill and decode"
    " is not built (use replicas)"
)


class Role(_Model):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"self.gpusPerPod == 0 ? {_RANKS} == 1"
                    f" : ({_RANKS}) % self.gpusPerPod == 0",
                    "message": "tensor × pipeline × data must be a multiple of gpusPerPod (1"
                    " when gpusPerPod is 0)",
                },
                # EPLB balances over the expert-parallel group (data × tensor ranks): its
                # redundant slots must split evenly over them.
                {
                    "rule": "!self.eplb.enabled || self.parallelism.expert",
                    "message": "eplb needs parallelism.expert: true",
                },
                {
                    "rule": f"!self.eplb.enabled || self.eplb.redundantExperts % ({_EP_GROUP})"
                    " == 0",
                    "message": "eplb.redundantExperts must be a multiple of the EP group"
                    " (parallelism.tensor × parallelism.data)",
                },
                {
                    # NOTE: the engine's data parallel (`DPAsyncLLM`) starts every rank's core on
                    # its own host; a group of several pods has no such server.
                    "rule": "self.parallelism.data == 1 || (self.parallelism.pipeline == 1 &&"
                    f" {_RANKS} <= self.gpusPerPod)",
                    "message": _DATA_IN_ONE_POD,
                },
            ]
        }
    )

    replicas: int = Field(default=1, ge=0)
    max_surge: int = Field(
        default=1,
        ge=1,
        description="groups a roll may add above replicas (draining ones count) before it"
        " drains the old ones",
    )
    drain_timeout_seconds: int = Field(
        default=600,
        ge=0,
        description="how long a group being removed may finish its in-flight requests and"
        " KV leases before it is deleted anyway",
    )
    parallelism: Parallelism = Field(default_factory=Parallelism)
    gpus_per_pod: int = Field(default=1, ge=0, le=16)
    eplb: EPLB = Field(default_factory=EPLB)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, str]] = Field(default_factory=list)

    @property
    def world_size(self) -> int:
        """Ranks in one replica group: tensor × pipeline × data."""
        p = self.parallelism
        return world_size(tensor=p.tensor, pipeline=p.pipeline, data=p.data)

    @property
    def group_size(self) -> int:
        """Pods in one replica group (`fleetserve.api.topology.group_size`)."""
        p = self.parallelism
        return group_size(
            tensor=p.tensor, pipeline=p.pipeline, data=p.data, gpus_per_pod=self.gpus_per_pod
        )


class Roles(_Model):
    model_config = ConfigDict(
        json_schema_extra=_cel(
            "has(self.unified) ? !has(self.prefill) && !has(self.decode)"
            " : has(self.prefill) && has(self.decode)",
            "roles must be either prefill and decode, or unified alone",
        )
    )

    prefill: Role | None = None
    decode: Role | None = None
    unified: Role | None = None

    def items(self) -> list[tuple[str, Role]]:
        """The roles present, in a fixed order (prefill, decode, unified)."""
        pairs = (("prefill", self.prefill), ("decode", self.decode), ("unified", self.unified))
        return [(name, role) for name, role in pairs if role is not None]


class Disaggregation(_Model):
    mode: Literal["always", "selective", "never"] = "always"
    min_uncached_tokens: int = Field(
        default=256,
        ge=0,
        description="selective mode: send a request through a prefill engine only when at least"
        " this many of its prompt tokens are not already cached on the chosen decode engine",
    )


class RouterSpec(_Model):
    replicas: int = Field(default=1, ge=0)
    drain_timeout_seconds: int = Field(
        default=600,
        ge=0,
        description="how long a stopping router pod (a roll, a scale-in) may finish the streams"
        " in flight through it before they are cut; it exits as soon as they are done",
    )
    disaggregation: Disaggregation = Field(default_factory=Disaggregation)
    prefix_aware: bool = True
    load_aware: bool = True
    node_selector: dict[str, str] = Field(
        default_factory=dict, description="where the router pods run (e.g. the engines' nodes)"
    )
    tolerations: list[dict[str, str]] = Field(default_factory=list)
    cpu: Quantity = Field(
        default="100m",
        description="CPU each router pod requests (no limit: a busy router uses up to a core)",
    )
    memory: Quantity = Field(
        default="256Mi",
        description="memory each router pod requests, and its limit (its queues and caches are"
        " bounded)",
    )


class RoleScaling(_Model):
    model_config = ConfigDict(
        json_schema_extra=_cel("self.min <= self.max", "autoscaling min must be <= max")
    )

    min: int = Field(default=1, ge=0)
    max: int = Field(default=1, ge=0)


class PrefillScaling(RoleScaling):
    """Prefill replicas follow input-side demand (prompt tokens arriving and queued)."""

    target_ttft_seconds: float = Field(
        default=2.0,
        ge=0.01,
        alias="targetTTFTSeconds",
        description="time to first token the prefill pool is sized for",
    )
    tokens_per_second: float = Field(
        default=4000.0,
        ge=1,
        description="prefill throughput of one replica, prompt tokens/s: the prior the"
        " autoscaler starts from until it has measured the engines under backlog",
    )


class DecodeScaling(RoleScaling):
    """Decode replicas follow KV usage, running requests and inter-token latency."""

    target_itl_seconds: float = Field(
        default=0.05,
        ge=0.001,
        alias="targetITLSeconds",
        description="inter-token latency the decode pool is sized for",
    )
    max_kv_usage: float = Field(
        default=0.8,
        ge=0.05,
        le=1,
        alias="maxKVUsage",
        description="KV cache fraction one decode replica may fill",
    )


class RatioBand(_Model):
    """Bounds on prefill replicas ÷ decode replicas (P:D)."""

    model_config = ConfigDict(
        json_schema_extra=_cel("self.min <= self.max", "autoscaling ratio min must be <= max")
    )

    min: float = Field(ge=0.01, description="lowest prefill ÷ decode replicas")
    max: float = Field(ge=0.01, description="highest prefill ÷ decode replicas")


class Autoscaling(_Model):
    model_config = ConfigDict(
        json_schema_extra=_cel(
            "!has(self.scaleUpStabilizationSeconds) || !has(self.scaleDownStabilizationSeconds)"
            " || self.scaleUpStabilizationSeconds <= self.scaleDownStabilizationSeconds",
            "autoscaling scaleUpStabilizationSeconds must be <= scaleDownStabilizationSeconds",
        )
    )

    enabled: bool = False
    prefill: PrefillScaling | None = None
    decode: DecodeScaling | None = None
    ratio: RatioBand | None = None
    interval_seconds: float = Field(
        default=2.0, ge=0.5, le=300, description="how often the engines are scraped and decided"
    )
    scale_up_stabilization_seconds: float = Field(
        default=2.0,
        ge=0,
        le=3600,
        description="a scale-up needs every recommendation of this window above the current size",
    )
    scale_down_stabilization_seconds: float = Field(
        default=300.0,
        ge=0,
        le=3600,
        description="a scale-down needs every recommendation of this window below the current size",
    )
    tolerance: float = Field(
        default=0.1,
        ge=0,
        le=0.9,
        description="needed ÷ current replicas within 1 ± tolerance keeps the current size",
    )

    @model_validator(mode="after")
    def _check(self) -> Autoscaling:
        if self.scale_up_stabilization_seconds > self.scale_down_stabilization_seconds:
            raise ValueError(
                "autoscaling.scaleUpStabilizationSeconds must be <= scaleDownStabilizationSeconds"
            )
        for name, scaling in (("prefill", self.prefill), ("decode", self.decode)):
            if scaling is not None and scaling.min > scaling.max:
                raise ValueError(f"autoscaling.{name}: min must be <= max")
        if self.ratio is not None and self.ratio.min > self.ratio.max:
            raise ValueError("autoscaling.ratio: min must be <= max")
        return self


_QUEUE_NAME = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
"""A LocalQueue name that is also a label value (Kueue reads it from a pod label)."""


class Scheduling(_Model):
    """How the cluster admits the deployment's replica groups."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "(has(self.gangAdmission) && self.gangAdmission == 'kueue')"
                    " == has(self.queueName)",
                    "message": "scheduling.queueName (a Kueue LocalQueue in the deployment's"
                    " namespace) is required with gangAdmission kueue, and only then",
                },
            ]
        }
    )

    gang_admission: Literal["none", "kueue"] = Field(
        default="none",
        description="none: each pod goes to the scheduler as it is created; kueue: each"
        " replica group is one Kueue pod group, admitted whole (all its pods get their GPUs)"
        " or not at all (its pods wait, gated, holding nothing)",
    )
    queue_name: str | None = Field(
        default=None,
        min_length=1,
        max_length=63,
        pattern=_QUEUE_NAME,
        description="with gangAdmission kueue: the Kueue LocalQueue, in the deployment's"
        " namespace, whose ClusterQueue's quota the groups are admitted against",
    )

    @model_validator(mode="after")
    def _check(self) -> Scheduling:
        if (self.gang_admission == "kueue") != (self.queue_name is not None):
            raise ValueError(
                "scheduling.queueName (a Kueue LocalQueue in the deployment's namespace) is"
                f" required with gangAdmission kueue, and only then (gangAdmission"
                f" {self.gang_admission!r}, queueName {self.queue_name!r})"
            )
        return self


_TENSOR_TRANSFER = (
    "prefill and decode roles with tensor > 1 need kvTransfer.transferMode pull (push moves KV"
    " between tensor 1 roles only)"
)


def _spec_rules() -> list[JsonValue]:
    """CEL rules across roles, connector and autoscaling (messages name the rule)."""
    return [
        {
            "rule": "self.model.moe || ((!has(self.roles.prefill) || (!self.roles.prefill.parallelism.expert"
            " && !self.roles.prefill.eplb.enabled)) && (!has(self.roles.decode) ||"
            " (!self.roles.decode.parallelism.expert && !self.roles.decode.eplb.enabled)) &&"
            " (!has(self.roles.unified) || (!self.roles.unified.parallelism.expert &&"
            " !self.roles.unified.eplb.enabled)))",
            "message": "expert parallel and EPLB need a MoE model (spec.model.moe: true)",
        },
        {
            "rule": "has(self.roles.unified) || (self.roles.prefill.parallelism.data == 1 &&"
            " self.roles.decode.parallelism.data == 1)",
            "message": _DATA_UNIFIED,
        },
        {
            "rule": "has(self.roles.unified) ? self.kvTransfer.connector == 'none'"
            " : self.kvTransfer.connector != 'none'",
            "message": "prefill/decode roles need a KV connector (tcp or mooncake); unified needs none",
        },
        {
            # What the engine's connector supports (issue 16): between tensor-parallel engines
            # of any sizes in pull mode (the handshake refuses KV heads that do not map); push
            # moves KV between tensor 1 engines only.
            "rule": "has(self.roles.unified) ||"
            " !has(self.kvTransfer.transferMode) || self.kvTransfer.transferMode == 'pull' ||"
            " (self.roles.prefill.parallelism.tensor == 1 &&"
            " self.roles.decode.parallelism.tensor == 1)",
            "message": _TENSOR_TRANSFER,
        },
        {
            "rule": "!has(self.autoscaling) || !self.autoscaling.enabled ||"
            " ((!has(self.autoscaling.prefill) || !has(self.roles.prefill) ||"
            " (self.autoscaling.prefill.min <= self.roles.prefill.replicas &&"
            " self.roles.prefill.replicas <= self.autoscaling.prefill.max)) &&"
            " (!has(self.autoscaling.decode) || !has(self.roles.decode) ||"
            " (self.autoscaling.decode.min <= self.roles.decode.replicas &&"
            " self.roles.decode.replicas <= self.autoscaling.decode.max)))",
            "message": "autoscaling needs min <= replicas <= max for each role",
        },
    ]


class InferenceDeploymentSpec(_Model):
    model_config = ConfigDict(json_schema_extra={"x-kubernetes-validations": _spec_rules()})

    model: ModelSpec
    engine: EngineSpec = Field(default_factory=EngineSpec)
    kv_transfer: KVTransfer = Field(default_factory=KVTransfer)
    roles: Roles
    router: RouterSpec = Field(default_factory=RouterSpec)
    autoscaling: Autoscaling = Field(default_factory=Autoscaling)
    scheduling: Scheduling = Field(default_factory=Scheduling)

    @model_validator(mode="after")
    def _check(self) -> InferenceDeploymentSpec:
        for name, role in self.roles.items():
            ranks = role.world_size
            if (role.gpus_per_pod == 0 and ranks != 1) or (
                role.gpus_per_pod and ranks % role.gpus_per_pod
            ):
                raise ValueError(
                    f"roles.{name}: tensor × pipeline × data must be a multiple of gpusPerPod"
                    f" (1 when gpusPerPod is 0), got {ranks} ranks and"
                    f" gpusPerPod {role.gpus_per_pod}"
                )
            if role.parallelism.data > 1 and (
                ranks > role.gpus_per_pod or role.parallelism.pipeline > 1
            ):
                raise ValueError(f"roles.{name}: {_DATA_IN_ONE_POD}, got {ranks} ranks and"
                                 f" gpusPerPod {role.gpus_per_pod}")  # fmt: skip
            if role.parallelism.data > 1 and name != "unified":
                raise ValueError(f"roles.{name}: {_DATA_UNIFIED}")
            if not self.model.moe and (role.parallelism.expert or role.eplb.enabled):
                raise ValueError(f"roles.{name}: expert parallel and EPLB need model.moe: true")
            p = role.parallelism
            if role.eplb.enabled and not p.expert:
                raise ValueError(f"roles.{name}: eplb needs parallelism.expert: true")
            if role.eplb.enabled and role.eplb.redundant_experts % (p.tensor * p.data):
                raise ValueError(
                    f"roles.{name}: eplb.redundantExperts must be a multiple of the EP group"
                    f" (parallelism.tensor × parallelism.data = {p.tensor * p.data}), got"
                    f" {role.eplb.redundant_experts}"
                )
            if (
                self.model.lora is not None
                and max(role.parallelism.tensor, role.parallelism.pipeline) > 1
            ):
                # NOTE: the engine refuses it too (sharded LoRA is not built).
                raise ValueError(
                    f"roles.{name}: model.lora needs tensor and pipeline parallel size 1"
                )
        has_pd = self.roles.prefill is not None and self.roles.decode is not None
        if has_pd == (self.roles.unified is not None) or has_pd != (
            self.kv_transfer.connector != "none"
        ):
            raise ValueError("roles/kvTransfer.connector: prefill+decode need a connector")
        if has_pd and self.kv_transfer.transfer_mode != "pull":
            sizes = {n: r.parallelism.tensor for n, r in self.roles.items()}
            if any(size != 1 for size in sizes.values()):
                raise ValueError(f"{_TENSOR_TRANSFER} (tensor sizes: {sizes})")
        if self.kv_transfer.protocol == "rdma" and self.kv_transfer.connector != "mooncake":
            raise ValueError(
                "kvTransfer.protocol rdma needs the mooncake connector (tcp runs over TCP only)"
            )
        return self


Phase = Literal["Pending", "Progressing", "Ready", "Degraded", "Failed"]
"""`Failed`: the operator cannot realise the spec (the Ready condition says why); it stays
Failed, without retrying, until the spec changes."""


class Condition(_Model):
    type: str
    status: Literal["True", "False", "Unknown"]
    reason: str = ""
    message: str = ""
    last_transition_time: str | None = None


class RoleStatus(_Model):
    replicas: int = 0
    ready_replicas: int = 0
    updated_replicas: int = 0
    group_size: int = 1
    compatibility_hash: str | None = Field(
        default=None, description="KV compatibility hash of this role's pods (their label)"
    )
    desired_replicas: int | None = Field(
        default=None,
        ge=0,
        description="groups the autoscaler wants (with autoscaling.enabled it overrides"
        " spec.roles.<role>.replicas)",
    )
    eplb_balancedness: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="EPLB: mean over the role's engines of their last window's mean ÷ max"
        " per-rank expert load (fleetserve:eplb_balancedness; 1 = even)",
    )


class ScaleDecisionRole(_Model):
    current: int = Field(description="groups before the decision (starting ones included)")
    ready: int = Field(default=0, description="groups whose engines reported metrics")
    desired: int
    needed: float = Field(default=0.0, description="replicas the load needs before bounds")
    reason: str = ""


class ScaleDecision(_Model):
    """The autoscaler's latest decision: what it read, and what it chose per role and why."""

    time: str
    reason: str
    roles: dict[str, ScaleDecisionRole] = Field(default_factory=dict)
    inputs: dict[str, float] = Field(
        default_factory=dict, description="the aggregated metrics the decision used"
    )


class RouterStatus(_Model):
    replicas: int = 0
    ready_replicas: int = 0


# NOTE: the operator builds this model and writes `model_dump(by_alias=True, exclude_none=True)`
# (fleetserve.operator.status), and the CRD's status schema is generated from it, so a field
# cannot exist on one side only (the API server would prune it silently).
class InferenceDeploymentStatus(_Model):
    model_config = ConfigDict(extra="ignore")

    observed_generation: int | None = None
    phase: Phase | None = None
    conditions: list[Condition] = Field(default_factory=list)
    roles: dict[str, RoleStatus] = Field(default_factory=dict)
    router: RouterStatus | None = None
    endpoint: str | None = None
    compatibility_hash: str | None = Field(
        default=None, description="the KV compatibility hash every role shares"
    )
    last_scale_decision: ScaleDecision | None = None
