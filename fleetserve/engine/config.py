"""Engine configuration: frozen dataclasses composed into one `EngineConfig`.

Every field is validated in `__post_init__`; bad values raise `ValueError` naming the field and the
allowed values. Values that depend on the model (e.g. `max_model_len` when left unset) are resolved by
`EngineArgs.create_engine_config()` (`fleetserve.engine.arg_utils`, the one definition of the
engine's arguments), which reads the model's HF `config.json`, so the dataclasses themselves never
hold "unset" placeholders once built.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from fleetserve.engine.custom_ops import is_resolved_custom_ops
from fleetserve.engine.generation_config import GenerationDefaults
from fleetserve.engine.lora.config import LoRAConfig
from fleetserve.engine.quantization.resolve import QuantizationConfig

DType = Literal["float32", "bfloat16", "float16"]
_DTYPES: tuple[str, ...] = ("auto", "float32", "bfloat16", "float16")
_DEVICES: tuple[str, ...] = ("auto", "cpu", "cuda")
_BACKENDS: tuple[str, ...] = ("auto", "torch", "triton", "flash_attn", "cpu_paged")
_POLICIES: tuple[str, ...] = ("fcfs", "priority")
_CUSTOM_OPS: tuple[str, ...] = ("auto", "torch", "triton")
_MOE_BACKENDS: tuple[str, ...] = ("auto", "torch", "triton")
_LOAD_FORMATS: tuple[str, ...] = ("safetensors", "dummy")
_EPLB_POLICIES: tuple[str, ...] = ("global", "hierarchical")
_EXECUTOR_BACKENDS: tuple[str, ...] = ("auto", "uni", "mp")
_KV_TRANSFER_CHOICES: dict[str, tuple[str, ...]] = {
    "connector": ("tcp", "mooncake"),
    "role": ("producer", "consumer", "both"),
    "protocol": ("tcp", "rdma"),
    "load_failure_policy": ("fail", "recompute"),
    "transfer_mode": ("pull", "push"),
}


def _require(cond: bool, name: str, allowed: str, value: object) -> None:
    if not cond:
        raise ValueError(f"{name} must be {allowed}, got {value!r}")


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """What to run: the HF model folder and its numeric settings."""

    model: str
    """Path to a Hugging Face model folder (config.json + *.safetensors + tokenizer files)."""
    dtype: DType
    """Weight and activation dtype (the KV cache uses the same)."""
    max_model_len: int
    """Longest sequence (prompt + output) a request may reach, in tokens."""
    seed: int = 0
    """Seed for requests without their own seed; random sampling stays reproducible per engine."""
    load_format: str = "safetensors"
    """'safetensors' (the folder's checkpoint) or 'dummy' (seeded random weights from config.json
    alone: benchmarks of a model's shape without its checkpoint)."""
    hf_config: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)
    """The parsed config.json (kept for model construction; not part of equality)."""

    def __post_init__(self) -> None:
        _require(self.dtype in _DTYPES[1:], "dtype", f"one of {_DTYPES[1:]}", self.dtype)
        _require(self.max_model_len > 0, "max_model_len", "a positive integer", self.max_model_len)
        _require(
            self.load_format in _LOAD_FORMATS,
            "load_format",
            f"one of {_LOAD_FORMATS}",
            self.load_format,
        )

    @property
    def architecture(self) -> str:
        archs = self.hf_config.get("architectures") or ["?"]
        return str(archs[0])

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config["vocab_size"])


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache settings."""

    block_size: int = 16
    """Tokens per KV block (also the prefix-cache hashing granularity)."""
    num_kv_blocks: int | None = None
    """Override of the memory-derived block count (including the null block 0)."""
    enable_prefix_caching: bool = True
    """Reuse full blocks whose chained hash matches an earlier request's."""
    watermark: float = 0.01
    """Fraction of blocks kept free when admitting new requests (avoids immediate preemption)."""
    gpu_memory_utilization: float = 0.9
    """Fraction of device memory the engine may use (CUDA only)."""
    cpu_kv_cache_space_bytes: int = 1 << 30
    """KV cache budget on the CPU when `num_kv_blocks` is unset (1 GiB; CPU memory is shared)."""

    def __post_init__(self) -> None:
        _require(
            self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
            "block_size",
            "a power of two between 1 and 128",
            self.block_size,
        )
        if self.num_kv_blocks is not None:
            _require(self.num_kv_blocks >= 2, "num_kv_blocks", "at least 2", self.num_kv_blocks)
        _require(0.0 <= self.watermark < 1.0, "watermark", "in [0, 1)", self.watermark)
        _require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            "gpu_memory_utilization",
            "in (0, 1]",
            self.gpu_memory_utilization,
        )


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous-batching scheduler settings (one token budget per step)."""

    max_num_seqs: int = 256
    """Most requests in RUNNING at once (batch slots)."""
    max_num_batched_tokens: int = 2048
    """Token budget of one step, shared by prefill chunks and decodes."""
    max_model_len: int = 2048
    """Copied from the model config so the scheduler can cap chunks without it."""
    enable_chunked_prefill: bool = True
    """Split prompts longer than the remaining budget across steps."""
    long_prefill_token_threshold: int = 0
    """Cap on one request's prefill chunk per step (0 = off); raised to the fair share adaptively."""
    policy: str = "fcfs"
    """Queue and preemption policy: 'fcfs' (preempt newest) or 'priority' (preempt lowest priority)."""
    full_sequence_must_fit: bool = False
    """Admit a request only when blocks for its whole prompt + max_tokens are free."""
    async_scheduling: bool = False
    """Schedule step N + 1 while step N runs (`fleetserve.engine.core.async_scheduling`):
    running decodes are scheduled again before their step-N token is known (one output
    placeholder each) and the runner feeds them the token it sampled itself."""

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs", "at least 1", self.max_num_seqs)
        _require(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            "at least 1",
            self.max_num_batched_tokens,
        )
        _require(
            self.long_prefill_token_threshold >= 0,
            "long_prefill_token_threshold",
            "0 (off) or positive",
            self.long_prefill_token_threshold,
        )
        _require(self.policy in _POLICIES, "policy", f"one of {_POLICIES}", self.policy)
        if not self.enable_chunked_prefill:
            _require(
                self.max_num_batched_tokens >= self.max_model_len,
                "max_num_batched_tokens",
                f">= max_model_len ({self.max_model_len}) when chunked prefill is off",
                self.max_num_batched_tokens,
            )


@dataclass(frozen=True, slots=True)
class ParallelConfig:
    """Model-parallel topology of one engine (replica group)."""

    tensor_parallel_size: int = 1
    """Ranks a layer's weights are split over (the fastest-varying rank dimension)."""
    pipeline_parallel_size: int = 1
    """Stages the layers are split into."""
    data_parallel_size: int = 1
    """Data-parallel ranks of one replica group (each schedules its own requests)."""
    enable_expert_parallel: bool = False
    """MoE experts sharded over data × tensor ranks instead of tensor-split."""
    pipeline_layer_partition: tuple[int, ...] | None = None
    """Decoder layers per pipeline stage (None: even, the remainder to the first stages)."""
    disable_custom_all_reduce: bool = False
    """Use gloo (or NCCL) for every all-reduce, not the CPU's shared-memory one for small
    tensors."""
    distributed_executor_backend: str = "auto"
    """'uni' (one worker in the engine core's process; one rank only), 'mp' (one worker
    process per rank) or 'auto' ('uni' for one rank, else 'mp'; see `executor_backend`)."""
    data_parallel_rank: int = 0
    """Which data-parallel rank this engine core is (set per core by `DPAsyncLLM`)."""
    force_dp_lockstep: bool = False
    """Run data-parallel ranks in lockstep even for a dense model (a test hook: it puts a real
    cross-rank collective in every forward, as the MoE layers do under expert parallelism)."""
    data_parallel_init_method: str | None = None
    """Lockstep only: the rendezvous every DP rank's workers join (one world across DP)."""

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            _require(getattr(self, name) >= 1, name, ">= 1", getattr(self, name))
        _require(
            0 <= self.data_parallel_rank < self.data_parallel_size,
            "data_parallel_rank",
            f"in [0, {self.data_parallel_size})",
            self.data_parallel_rank,
        )
        _require(
            self.distributed_executor_backend in _EXECUTOR_BACKENDS,
            "distributed_executor_backend",
            f"one of {_EXECUTOR_BACKENDS}",
            self.distributed_executor_backend,
        )
        if self.distributed_executor_backend == "uni":
            _require(
                self.world_size == 1,
                "distributed_executor_backend",
                f"'mp' or 'auto' for {self.world_size} ranks (tensor × pipeline; 'uni' runs one)",
                self.distributed_executor_backend,
            )

    @property
    def executor_backend(self) -> str:
        """The executor that runs the workers: 'uni' or 'mp' ('auto' resolved by world size)."""
        if self.distributed_executor_backend != "auto":
            return self.distributed_executor_backend
        return "uni" if self.world_size == 1 else "mp"

    @property
    def world_size(self) -> int:
        """Ranks of one data-parallel rank's model: tensor × pipeline."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @property
    def world_size_across_dp(self) -> int:
        """Ranks of the whole replica group: tensor × pipeline × data."""
        return self.world_size * self.data_parallel_size

    @property
    def needs_dp_lockstep(self) -> bool:
        """Whether the data-parallel ranks must step together: their workers share collectives
        (the EP group spans DP × TP), so an idle rank runs dummy forwards while others work."""
        return self.data_parallel_size > 1 and (
            self.enable_expert_parallel or self.force_dp_lockstep
        )


@dataclass(frozen=True, slots=True)
class EPLBConfig:
    """Expert-parallel load balancing (field names as the CRD's `eplb` block)."""

    enabled: bool = False
    redundant_experts: int = 0
    """Extra physical expert slots, filled with replicas of the hottest experts."""
    window_size: int = 1000
    """Steps whose expert load a rebalance looks at."""
    step_interval: int = 3000
    """Steps between rebalances."""
    policy: str = "global"
    """'global' or 'hierarchical' (DeepSeek's EPLB placement)."""
    use_async: bool = False
    """Stage moved expert weights in the background and switch between steps (else the
    rebalance step moves them before it returns)."""

    def __post_init__(self) -> None:
        _require(self.redundant_experts >= 0, "redundant_experts", ">= 0", self.redundant_experts)
        _require(self.window_size >= 1, "window_size", ">= 1", self.window_size)
        _require(self.step_interval >= 1, "step_interval", ">= 1", self.step_interval)
        _require(self.policy in _EPLB_POLICIES, "policy", f"one of {_EPLB_POLICIES}", self.policy)


@dataclass(frozen=True, slots=True)
class KVTransferConfig:
    """The KV connector of a P/D engine (`--kv-transfer-config` JSON; keys as the CRD's
    `kvTransfer` block in snake_case, plus the engine's role in the pair)."""

    connector: str
    """'tcp' or 'mooncake'."""
    role: str
    """'producer' (prefill), 'consumer' (decode) or 'both'."""
    protocol: str = "tcp"
    """Transport under the connector: 'tcp' or 'rdma'."""
    lease_seconds: float = 30.0
    """How long a producer keeps a finished prompt's blocks for its consumer."""
    load_failure_policy: str = "fail"
    """'fail' (end the request with an error) or 'recompute' (recompute the missing tokens)."""
    transfer_mode: str = "pull"
    """'pull' (the consumer reads) or 'push' (the producer writes as layers are computed)."""
    host: str = "127.0.0.1"
    """The address peers reach this engine's connector at (a pod's IP; loopback on one box)."""
    side_channel_port: int = 0
    """The control channel's port (0: any free port; peers learn it from the requests)."""
    handshake_timeout_s: float = 5.0
    """A peer that does not answer a handshake within this fails the requests naming it."""
    transfer_timeout_s: float = 30.0
    """A load not finished within this of its start fails (the watchdog)."""
    num_threads: int = 4
    """Cap on the transport's threads and lanes per peer (NICs limit them; seed part 2 §2.8)."""

    def __post_init__(self) -> None:
        for name, allowed in _KV_TRANSFER_CHOICES.items():
            value = getattr(self, name)
            _require(value in allowed, f"kv_transfer_config.{name}", f"one of {allowed}", value)
        for name in ("lease_seconds", "handshake_timeout_s", "transfer_timeout_s"):
            value = getattr(self, name)
            _require(value > 0, f"kv_transfer_config.{name}", "a positive number", value)
        _require(
            0 <= self.side_channel_port < 65536,
            "kv_transfer_config.side_channel_port",
            "a TCP port (0: any)",
            self.side_channel_port,
        )
        _require(
            1 <= self.num_threads <= 64,
            "kv_transfer_config.num_threads",
            "in [1, 64]",
            self.num_threads,
        )

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> KVTransferConfig:
        """Parse the JSON object of `--kv-transfer-config`.

        Raises:
            ValueError: an unknown or missing key, or a bad value (each named).
        """
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise ValueError(f"kv_transfer_config keys must be among {known}, got {unknown}")
        for required in ("connector", "role"):
            if required not in data:
                raise ValueError(f"kv_transfer_config.{required} is required")
        return cls(**data)


_SPEC_METHODS: tuple[str, ...] = ("ngram", "draft_model")
_SPEC_KEYS: dict[str, tuple[str, ...]] = {
    "ngram": ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"),
    "draft_model": ("method", "num_speculative_tokens", "model"),
}
MAX_SPECULATIVE_TOKENS = 16
"""Upper bound on drafts per step (each verified position costs a logits row)."""


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (`--speculative-config` JSON, vLLM's shape).

    `{"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_max": 4,
    "prompt_lookup_min": 1}` proposes, by prompt lookup, the k tokens that followed the latest
    earlier occurrence of the request's last n tokens (n from max down to min);
    `{"method": "draft_model", "model": path, "num_speculative_tokens": k}` runs a smaller model
    of the same vocabulary for k steps. Either way the target verifies the k drafts in one forward
    pass and rejection sampling keeps its output distribution exact.
    """

    method: str
    """'ngram' (prompt lookup, no extra model) or 'draft_model'."""
    num_speculative_tokens: int
    """Drafts proposed per request and step (k)."""
    prompt_lookup_max: int = 4
    """ngram: the longest suffix n-gram looked up."""
    prompt_lookup_min: int = 1
    """ngram: the shortest suffix n-gram looked up."""
    model: str | None = None
    """draft_model: the draft's HF model folder (same tokenizer and vocabulary as the target)."""

    def __post_init__(self) -> None:
        _require(
            self.method in _SPEC_METHODS,
            "speculative_config.method",
            f"one of {_SPEC_METHODS}",
            self.method,
        )
        _require(
            isinstance(self.num_speculative_tokens, int)
            and 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS,
            "speculative_config.num_speculative_tokens",
            f"an integer in [1, {MAX_SPECULATIVE_TOKENS}]",
            self.num_speculative_tokens,
        )
        if self.method == "ngram":
            _require(
                isinstance(self.prompt_lookup_min, int) and self.prompt_lookup_min >= 1,
                "speculative_config.prompt_lookup_min",
                "an integer >= 1",
                self.prompt_lookup_min,
            )
            _require(
                isinstance(self.prompt_lookup_max, int)
                and self.prompt_lookup_max >= self.prompt_lookup_min,
                "speculative_config.prompt_lookup_max",
                f"an integer >= prompt_lookup_min ({self.prompt_lookup_min})",
                self.prompt_lookup_max,
            )
        else:
            _require(
                isinstance(self.model, str) and bool(self.model),
                "speculative_config.model",
                "the draft model's folder (required for method 'draft_model')",
                self.model,
            )

    @property
    def num_lookahead_tokens(self) -> int:
        """KV slots reserved past the verified tokens: a draft model writes its own KV for
        the next k drafts at positions the verification step does not cover."""
        return self.num_speculative_tokens if self.method == "draft_model" else 0

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SpeculativeConfig:
        """Parse the JSON object of `--speculative-config`.

        Raises:
            ValueError: an unknown method, a key that method does not take, a missing key or
                a bad value (each named).
        """
        method = data.get("method")
        if method not in _SPEC_KEYS:
            raise ValueError(
                f"speculative_config.method must be one of {_SPEC_METHODS}, got {method!r}"
            )
        allowed = _SPEC_KEYS[method]
        unknown = sorted(set(data) - set(allowed))
        if unknown:
            raise ValueError(
                f"speculative_config keys for method {method!r} must be among {list(allowed)}, "
                f"got {unknown}"
            )
        if "num_speculative_tokens" not in data:
            raise ValueError("speculative_config.num_speculative_tokens is required")
        return cls(**data)


@dataclass(frozen=True, slots=True)
class DeviceConfig:
    """Where the model runs and which attention backend it uses."""

    device: str = "cpu"
    """'cpu' or 'cuda' (resolved from 'auto' by `EngineArgs.create_engine_config`)."""
    attention_backend: str = "auto"
    """'auto', 'torch', 'triton' or 'flash_attn'."""
    custom_ops: str = "torch"
    """Implementation of RMSNorm, rotary and SiLU-and-mul: 'torch' (eager ops), 'triton' (the
    fused kernels of `fleetserve.kernels`: Triton on CUDA, C++ on the CPU) or '+op,...'
    (`fleetserve.engine.custom_ops`); `EngineArgs` resolves 'auto' to every fused kernel on CUDA,
    and on the CPU from `-O1`."""
    enforce_eager: bool = False
    """Never capture CUDA graphs (every step runs eagerly); only meaningful on CUDA."""
    moe_backend: str = "auto"
    """MoE expert GEMMs: 'torch', 'triton' (the fused kernel) or 'auto' (triton on CUDA, torch
    on the CPU; `fleetserve.engine.layers.fused_moe.selector`)."""
    optimization_level: int = 2
    """The `-O` level the knobs above were defaulted from (named in optimisation failures)."""
    compile_min_tokens: int = 0
    """CPU: steps of at least this many tokens run the torch.compile'd elementwise pieces
    (`fleetserve.engine.compilation.pieces`); 0 compiles nothing."""

    def __post_init__(self) -> None:
        _require(self.device in _DEVICES[1:], "device", f"one of {_DEVICES[1:]}", self.device)
        _require(
            self.compile_min_tokens >= 0, "compile_min_tokens", ">= 0", self.compile_min_tokens
        )
        _require(
            self.compile_min_tokens == 0 or self.device == "cpu",
            "compile_min_tokens",
            "0 on cuda (the compiled pieces are built for the CPU only)",
            self.compile_min_tokens,
        )
        _require(
            self.attention_backend in _BACKENDS,
            "attention_backend",
            f"one of {_BACKENDS}",
            self.attention_backend,
        )
        _require(
            is_resolved_custom_ops(self.custom_ops),
            "custom_ops",
            f"one of {_CUSTOM_OPS[1:]} or '+op,...' (fleetserve.engine.custom_ops)",
            self.custom_ops,
        )
        _require(
            self.moe_backend in _MOE_BACKENDS,
            "moe_backend",
            f"one of {_MOE_BACKENDS}",
            self.moe_backend,
        )


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Everything one engine needs; built once and shared read-only by all components."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    device: DeviceConfig
    eplb: EPLBConfig = field(default_factory=EPLBConfig)
    kv_transfer: KVTransferConfig | None = None
    """The KV connector of a P/D engine; None = no connector (a colocated engine)."""
    speculative: SpeculativeConfig | None = None
    """Speculative decoding; None = off."""
    quantization: QuantizationConfig | None = None
    """Quantized linear layers (online or a quantized checkpoint's); None = the engine dtype."""
    generation: GenerationDefaults = field(default_factory=GenerationDefaults)
    """Sampling defaults for what a request leaves unset (`--generation-config`)."""
    lora: LoRAConfig | None = None
    """Multi-LoRA serving (`fleetserve.engine.lora`); None = off."""

    @classmethod
    def create(cls, model: str, **kwargs: Any) -> EngineConfig:
        """`EngineArgs(model=model, **kwargs).create_engine_config()` (the keywords are the
        `EngineArgs` fields; unknown ones raise ValueError)."""
        from fleetserve.engine.arg_utils import EngineArgs

        return EngineArgs.from_kwargs(model=model, **kwargs).create_engine_config()


def require_choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    """Raises ValueError naming `name` unless `value` is one of `allowed`."""
    _require(value in allowed, name, f"one of {allowed}", value)


def load_hf_config(model: str) -> dict[str, Any]:
    """Read `config.json` from a model folder, with a clear error when it is not one."""
    path = Path(model) / "config.json"
    if not path.is_file():
        raise ValueError(
            f"model must be a Hugging Face model folder with config.json, got {model!r}"
        )
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def resolve_device(device: str) -> str:
    """'auto' → 'cuda' when torch sees a GPU, else 'cpu'."""
    if device != "auto":
        return device
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(dtype: str, hf_config: dict[str, Any], device: str) -> DType:
    """'auto' → float32 on the CPU, the checkpoint's bf16/fp16 on CUDA."""
    if dtype != "auto":
        return dtype  # type: ignore[return-value]
    if device == "cpu":
        # NOTE: CPUs without native bf16 (AVX2-only) run bf16 matmuls far slower than fp32.
        return "float32"
    declared = str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "bfloat16")
    return "bfloat16" if declared in ("float32", "bfloat16") else "float16"
