"""`EngineArgs`: the one definition of the engine's arguments.

Every field is one argument: the `LLM(**kwargs)` keyword of the same name, the `fleetserve serve`
flag with dashes (`--max-num-seqs`), and what the operator renders into engine pods (a test parses
every rendered flag). `add_cli_args` generates the flags from the fields (type, default, choices
and help from the field's metadata); `create_engine_config` resolves the values against the model
folder and the machine into the frozen `EngineConfig`, refusing, with a message naming the option,
every option whose feature this build does not implement yet.

Adding a knob means adding one field here (and reading it in `create_engine_config`).
"""

from __future__ import annotations

import argparse
import json
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from typing import Any

from fleetserve.engine.compilation.levels import DEFAULT_LEVEL, level_defaults, resolve_knobs
from fleetserve.engine.config import (
    CacheConfig,
    DeviceConfig,
    EngineConfig,
    EPLBConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    SpeculativeConfig,
    load_hf_config,
    require_choice,
    resolve_device,
    resolve_dtype,
)
from fleetserve.engine.custom_ops import resolve_custom_ops
from fleetserve.engine.eplb.args import check_eplb_args
from fleetserve.engine.generation_config import load_generation_defaults
from fleetserve.engine.lora.config import LoRAConfig, parse_lora_modules
from fleetserve.engine.quantization.resolve import (
    QuantizationConfig,
    resolve_engine_quantization,
)
from fleetserve.envs import Env, env_name, read_env

__all__ = ["EngineArgs", "async_scheduling_blockers"]


def _arg(default: Any, help: str, *, choices: tuple[str, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass
class EngineArgs:
    """Engine arguments with their defaults (vLLM's names where vLLM has the option)."""

    model: str | None = _arg(None, "HF model folder (default: the bundled SmolLM2-135M-Instruct)")
    dtype: str = _arg("auto", "weights, activations and KV cache",
                      choices=("auto", "float32", "bfloat16", "float16"))  # fmt: skip
    device: str = _arg("auto", "where the model runs", choices=("auto", "cpu", "cuda"))
    seed: int = _arg(0, "seed of requests without their own")
    load_format: str = _arg("safetensors", "safetensors, or dummy (seeded random weights)",
                            choices=("safetensors", "dummy"))  # fmt: skip
    skip_tokenizer_init: bool = _arg(False, "load no tokenizer: token-id prompts and outputs "
                                     "only, text fields refused")  # fmt: skip
    max_model_len: int | None = _arg(None, "longest prompt + output (default: the model's)")
    block_size: int = _arg(16, "tokens per KV block (a power of two up to 128)")
    num_kv_blocks: int | None = _arg(None, "KV blocks incl. the null block (default: memory)")
    gpu_memory_utilization: float = _arg(0.9, "fraction of GPU memory the engine may use")
    enable_prefix_caching: bool = _arg(True, "reuse KV blocks of earlier identical prefixes")
    max_num_seqs: int = _arg(256, "most requests running at once")
    max_num_batched_tokens: int = _arg(2048, "token budget of one step")
    enable_chunked_prefill: bool = _arg(True, "split long prompts across steps")
    long_prefill_token_threshold: int = _arg(0, "cap on one prompt's chunk per step (0 = off)")
    scheduling_policy: str = _arg("fcfs", "queue order and preemption victim",
                                  choices=("fcfs", "priority"))  # fmt: skip
    full_sequence_must_fit: bool = _arg(False, "admit only when prompt + max_tokens fit")
    attention_backend: str = _arg("auto", "attention implementation",
                                  choices=("auto", "torch", "triton", "flash_attn", "cpu_paged"))  # fmt: skip
    custom_ops: str = _arg("auto", "which of RMSNorm, rotary and SiLU-and-mul run as custom "
                           "kernels: all, none, or +op/-op over the platform default (all on "
                           "CUDA, and on the CPU from -O1), e.g. none,+rms_norm (names: rms_norm, rotary, silu_and_mul; "
                           "triton/torch = all/none)")  # fmt: skip
    enforce_eager: bool | None = _arg(
        None, "never capture CUDA graphs (unset: from the optimization level; -O0 sets it)"
    )
    tensor_parallel_size: int = _arg(1, "tensor-parallel ranks")
    pipeline_parallel_size: int = _arg(1, "pipeline stages")
    pipeline_layer_partition: str | None = _arg(
        None, "decoder layers per pipeline stage, comma-separated, e.g. 3,5 (default: even)"
    )
    data_parallel_size: int = _arg(1, "data-parallel ranks of one replica group")
    enable_expert_parallel: bool = _arg(False, "shard MoE experts over data x tensor ranks")
    disable_custom_all_reduce: bool = _arg(
        False,
        "every all-reduce through gloo/NCCL (not the shared-memory one for small CPU tensors)",
    )
    distributed_executor_backend: str = _arg(
        "auto", "workers: uni (in the engine core's process, one rank) or mp (a process per "
        "rank); auto: uni for one rank, else mp", choices=("auto", "uni", "mp"),
    )  # fmt: skip
    enable_eplb: bool = _arg(False, "rebalance MoE experts from measured load (EPLB)")
    num_redundant_experts: int = _arg(0, "EPLB: extra expert replicas")
    eplb_window_size: int = _arg(1000, "EPLB: steps of load kept for a rebalance")
    eplb_step_interval: int = _arg(3000, "EPLB: steps between rebalances")
    eplb_policy: str = _arg("global", "EPLB: placement policy", choices=("global", "hierarchical"))
    kv_transfer_config: dict[str, Any] | None = _arg(  # noqa: RUF009 - _arg returns a field()
        None, 'KV connector settings, JSON: {"connector": "tcp", "role": "producer", ...}'
    )
    speculative_config: dict[str, Any] | None = _arg(  # noqa: RUF009 - _arg returns a field()
        None,
        'speculative decoding, JSON: {"method": "ngram", "num_speculative_tokens": 3, '
        '"prompt_lookup_max": 4, "prompt_lookup_min": 1} or {"method": "draft_model", '
        '"model": PATH, "num_speculative_tokens": 3}',
    )
    moe_backend: str = _arg("auto", "MoE expert GEMMs (auto: triton on CUDA, torch on the CPU)",
                            choices=("auto", "torch", "triton"))  # fmt: skip
    eplb_use_async: bool = _arg(
        False, "EPLB: move expert weights in the background, switch between steps"
    )
    quantization: str | None = _arg(
        None, "quantized linear layers: online int8_per_channel_weight_only (int8), "
        "fp8_per_tensor (fp8), online (from --quantization-config), or compressed-tensors (a "
        "quantized checkpoint; also the default when config.json has quantization_config)",
    )  # fmt: skip
    quantization_config: dict[str, Any] | None = _arg(  # noqa: RUF009 - _arg returns a field()
        None, 'online quantization, JSON: {"linear": "int8_per_channel_static", "ignore": '
        '["re:.*down_proj"], "targets": {"model.layers.0.*": "fp8_per_tensor"}} (targets '
        "excludes linear/moe)",
    )  # fmt: skip
    generation_config: str = _arg("auto", "where sampling defaults come from: auto (the "
                                  "model's generation_config.json), vllm (neutral), or a "
                                  "folder with generation_config.json")  # fmt: skip
    enable_lora: bool = _arg(False, "serve LoRA adapters (PEFT folders) beside the base model")
    max_loras: int = _arg(1, "LoRA: adapters in device slots (one step mixes at most these)")
    max_cpu_loras: int | None = _arg(None, "LoRA: adapters cached in host memory (max_loras)")
    max_lora_rank: int = _arg(16, "LoRA: largest adapter rank (8, 16, 32, 64, 128 or 256)")
    lora_modules: list[str] | None = _arg(  # noqa: RUF009 - _arg returns a field()
        None, "LoRA: adapters served from start-up, as name=path items"
    )
    optimization_level: int = _arg(
        DEFAULT_LEVEL,
        "-O0..-O3: defaults for the speed knobs left unset (explicit flags win); 0 compiles and "
        "captures nothing (torch attention, no CUDA graphs), 1-3 fused CPU attention and CUDA "
        "graphs, 3 also torch.compile on the CPU (fleetserve/engine/compilation/levels.py)",
    )
    async_scheduling: bool | None = _arg(
        None,
        "schedule step N+1 while step N runs (one rank; steps with structured output run "
        "synchronously; refused with speculative decoding or a KV connector); unset: from -O",
    )
    compile_min_tokens: int | None = _arg(
        None,
        "CPU: steps of at least this many tokens run torch.compile'd (Inductor) elementwise "
        "pieces around the GEMMs and attention, cached on disk; 0: never (unset: from -O; "
        "-O3: 256)",
    )

    @classmethod
    def names(cls) -> list[str]:
        """The argument names (the `LLM` keywords), in declaration order."""
        return [f.name for f in fields(cls)]

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """Build from keywords (the `LLM` constructor's).

        Raises:
            ValueError: an unknown keyword (the message lists the known ones).
        """
        unknown = sorted(set(kwargs) - set(cls.names()))
        if unknown:
            raise ValueError(
                f"unknown engine argument(s) {unknown}; the engine takes {cls.names()}"
            )
        return cls(**kwargs)

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser) -> None:
        """Add one flag per field (`--max-num-seqs`), `model` as the optional positional."""
        hints = typing.get_type_hints(cls)
        group = parser.add_argument_group("engine")
        for f in fields(cls):
            help_text, choices = (
                f.metadata["help"] + " (default: %(default)s)",
                f.metadata["choices"],
            )
            if f.name == "model":
                group.add_argument("model", nargs="?", default=None, help=help_text)
                continue
            flag = "--" + f.name.replace("_", "-")
            kind = _base_type(hints[f.name])
            if kind is bool:
                group.add_argument(flag, action=argparse.BooleanOptionalAction,
                                   default=f.default, help=help_text)  # fmt: skip
                continue
            if kind is list:
                group.add_argument(flag, nargs="+", default=f.default, help=help_text)
                continue
            parse: Any = _json_object(flag) if kind is dict else kind
            default = f.default if f.default is not MISSING else None
            # NOTE: vLLM's short form, -O2 (or -O 2), for the optimization level.
            short = ("-O",) if f.name == "optimization_level" else ()
            group.add_argument(*short, flag, type=parse, default=default, choices=choices,
                               help=help_text)  # fmt: skip

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> EngineArgs:
        """The fields' values from parsed flags (other attributes are ignored)."""
        return cls(**{name: getattr(namespace, name) for name in cls.names()})

    def create_engine_config(self, env: Env | None = None) -> EngineConfig:
        """Resolve against the model folder, the machine and the pod's environment.

        'auto' values are resolved here (device, dtype, custom ops, max_model_len), so the frozen
        config holds only concrete values.

        Raises:
            ValueError: a bad value, a feature this build does not implement, or a pod
                environment that contradicts the arguments (each message names the option).
        """
        _refuse_unimplemented(self)
        _check_group_env(self, read_env() if env is None else env)
        model = self.model
        if model is None:
            from fleetserve.engine.models.bundled import bundled_model_path

            model = str(bundled_model_path())
        hf_config = load_hf_config(model)
        _check_expert_parallel(self, hf_config)
        check_eplb_args(
            enable_eplb=self.enable_eplb,
            enable_expert_parallel=self.enable_expert_parallel,
            num_redundant_experts=self.num_redundant_experts,
            tensor_parallel_size=self.tensor_parallel_size,
            data_parallel_size=self.data_parallel_size,
            hf_config=hf_config,
        )
        for f in fields(self):
            if f.metadata["choices"] is not None:
                require_choice(f.name, getattr(self, f.name), f.metadata["choices"])
        device = resolve_device(self.device)
        knobs = resolve_knobs(
            self.optimization_level,
            device,
            self.enforce_eager,
            self.attention_backend,
            self.compile_min_tokens,
            _async_scheduling(self),
        )
        custom_ops = resolve_custom_ops(
            self.custom_ops,
            device,
            cpu_kernels=level_defaults(self.optimization_level).fused_cpu_attention,
        )
        model_limit = int(hf_config.get("max_position_embeddings", 2048))
        max_model_len = model_limit if self.max_model_len is None else self.max_model_len
        if max_model_len > model_limit:
            raise ValueError(
                f"max_model_len must be <= the model's max_position_embeddings ({model_limit}), "
                f"got {max_model_len}"
            )
        max_num_batched_tokens = self.max_num_batched_tokens
        if not self.enable_chunked_prefill:
            max_num_batched_tokens = max(max_num_batched_tokens, max_model_len)
        return EngineConfig(
            model=ModelConfig(
                model=model,
                dtype=resolve_dtype(self.dtype, hf_config, device),
                max_model_len=max_model_len,
                seed=self.seed,
                load_format=self.load_format,
                hf_config=hf_config,
            ),
            cache=CacheConfig(
                block_size=self.block_size,
                num_kv_blocks=self.num_kv_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
                gpu_memory_utilization=self.gpu_memory_utilization,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_num_batched_tokens,
                max_model_len=max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                long_prefill_token_threshold=self.long_prefill_token_threshold,
                policy=self.scheduling_policy,
                full_sequence_must_fit=self.full_sequence_must_fit,
                async_scheduling=knobs.async_scheduling,
            ),
            parallel=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                pipeline_parallel_size=self.pipeline_parallel_size,
                pipeline_layer_partition=_layer_partition(self, hf_config),
                data_parallel_size=self.data_parallel_size,
                enable_expert_parallel=self.enable_expert_parallel,
                disable_custom_all_reduce=self.disable_custom_all_reduce,
                distributed_executor_backend=self.distributed_executor_backend,
            ),
            device=DeviceConfig(
                device=device,
                attention_backend=knobs.attention_backend,
                custom_ops=custom_ops,
                enforce_eager=knobs.enforce_eager,
                moe_backend=self.moe_backend,
                optimization_level=self.optimization_level,
                compile_min_tokens=knobs.compile_min_tokens,
            ),
            eplb=EPLBConfig(
                enabled=self.enable_eplb,
                redundant_experts=self.num_redundant_experts,
                window_size=self.eplb_window_size,
                step_interval=self.eplb_step_interval,
                policy=self.eplb_policy,
                use_async=self.eplb_use_async,
            ),
            kv_transfer=(
                None
                if self.kv_transfer_config is None
                else KVTransferConfig.from_dict(self.kv_transfer_config)
            ),
            speculative=_speculative_config(
                self.speculative_config,
                hf_config,
                max_model_len,
                kv_transfer=self.kv_transfer_config is not None,
            ),
            quantization=_quantization(self, hf_config),
            generation=load_generation_defaults(self.generation_config, model),
            lora=_lora_config(self),
        )


# NOTE: each entry names an option whose feature is not built yet, the issue that builds it, and
# when the option counts as "asked for". Lift an entry when its issue lands.
_UNIMPLEMENTED: tuple[tuple[str, str, str], ...] = ()
_EPLB_ONLY = (
    "num_redundant_experts",
    "eplb_window_size",
    "eplb_step_interval",
    "eplb_policy",
    "eplb_use_async",
)


def _refuse_unimplemented(args: EngineArgs) -> None:
    defaults = EngineArgs()
    for name, feature, issue in _UNIMPLEMENTED:
        value = getattr(args, name)
        if value != getattr(defaults, name):
            raise ValueError(
                f"{name}={value!r} asks for {feature}, which this build does not implement yet "
                f"({issue}); leave {name} at its default ({getattr(defaults, name)!r})"
            )
    kv = args.kv_transfer_config
    if kv is not None and args.pipeline_parallel_size > 1:
        raise ValueError(
            f"pipeline_parallel_size={args.pipeline_parallel_size} with kv_transfer_config asks "
            "for KV transfer between pipeline stages, which this build does not implement yet "
            "(issue 16); P/D engines need pipeline_parallel_size 1 (tensor parallel is supported "
            "in pull mode)"
        )
    if kv is not None and args.tensor_parallel_size > 1:
        mode = kv.get("transfer_mode", "pull")
        if mode != "pull":
            raise ValueError(
                f"tensor_parallel_size={args.tensor_parallel_size} with kv_transfer_config "
                f"transfer_mode {mode!r} is not implemented (issue 16): KV transfer between "
                "tensor-parallel engines needs transfer_mode 'pull' (tcp or mooncake)"
            )
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        value = getattr(args, name)
        if args.speculative_config is not None and value > 1:
            # NOTE: drafts are proposed and verified on one rank's runner; several ranks would
            # need them broadcast (and a draft model sharded), which is not built.
            raise ValueError(
                f"{name}={value} with speculative_config is not implemented yet; speculative "
                f"decoding needs {name}=1"
            )
    _refuse_unimplemented_data_parallel(args)
    for name in _EPLB_ONLY:
        if getattr(args, name) != getattr(defaults, name) and not args.enable_eplb:
            raise ValueError(f"{name} is an EPLB setting; it needs enable_eplb=True")


def _refuse_unimplemented_data_parallel(args: EngineArgs) -> None:
    """Data parallel is built for one pod's colocated engines (`DPAsyncLLM`); refuse the rest."""
    size = args.data_parallel_size
    if size == 1:
        return
    if args.kv_transfer_config is not None:
        raise ValueError(
            f"data_parallel_size={size} with kv_transfer_config asks for KV transfer between "
            "data-parallel ranks, which this build does not implement yet (issue 16); run P/D "
            "engines with data_parallel_size 1 and scale them with replicas"
        )
    if args.pipeline_parallel_size > 1:
        raise ValueError(
            f"data_parallel_size={size} with pipeline_parallel_size="
            f"{args.pipeline_parallel_size} is not implemented yet (issue 16); data parallel "
            "needs pipeline_parallel_size 1"
        )
    if args.enable_expert_parallel and args.tensor_parallel_size > 1:
        # NOTE: lockstep ranks run one in-process worker each; a lockstep rank driving a
        # multi-process executor over a slice of the shared world is not built.
        raise ValueError(
            f"data_parallel_size={size} with enable_expert_parallel and tensor_parallel_size="
            f"{args.tensor_parallel_size} is not implemented yet (issue 16); lockstep data "
            "parallel needs tensor_parallel_size 1"
        )
    if args.enable_expert_parallel and args.speculative_config is not None:
        # NOTE: a draft's forwards would meet no dummy forward on the other ranks.
        raise ValueError(
            f"data_parallel_size={size} with enable_expert_parallel and speculative_config is "
            "not implemented yet (issue 16): lockstep data parallel runs without speculation"
        )


def _check_expert_parallel(args: EngineArgs, hf_config: dict[str, Any]) -> None:
    """Expert parallelism shards MoE experts: refused, by name, for a dense model."""
    from fleetserve.engine.models.moe_arch import MOE_ARCHITECTURES, is_moe_config

    if args.enable_expert_parallel and not is_moe_config(hf_config):
        arch = (hf_config.get("architectures") or ["?"])[0]
        raise ValueError(
            f"enable_expert_parallel=True asks for expert parallelism of the dense model "
            f"{arch!r}, which this build does not implement yet (issue 17): it applies to MoE "
            f"architectures only ({', '.join(sorted(MOE_ARCHITECTURES))})"
        )


def async_scheduling_blockers(
    *,
    speculative: bool,
    kv_transfer: bool,
    tensor_parallel_size: int,
    pipeline_parallel_size: int,
    executor_backend: str,
    dp_lockstep: bool,
) -> list[tuple[str, str]]:
    """Why this engine cannot schedule asynchronously (`fleetserve.engine.core.async_scheduling`): (option, reason) pairs, empty if it can.

    Each entry names the option that rules it out, so `--async-scheduling` with it is refused
    by name (a flag is never accepted and then ignored).
    """
    blockers: list[tuple[str, str]] = []
    if speculative:
        blockers.append(("speculative_config",
                         "each step's drafts come from the previous step's output"))  # fmt: skip
    if kv_transfer:
        blockers.append(("kv_transfer_config", "a KV connector's per-step metadata and "
                         "transfer polling need each step's result before the next"))  # fmt: skip
    for name, size in (("tensor_parallel_size", tensor_parallel_size),
                       ("pipeline_parallel_size", pipeline_parallel_size)):  # fmt: skip
        if size > 1:
            blockers.append((name, "the worker thread runs one in-process rank"))
    if executor_backend == "mp":
        blockers.append(("distributed_executor_backend", "async scheduling runs the 'uni' "
                         "executor's worker thread"))  # fmt: skip
    if dp_lockstep:
        blockers.append(("data_parallel_size", "lockstep data parallel runs one forward per "
                         "wave iteration on every rank"))  # fmt: skip
    return blockers


def _async_scheduling(args: EngineArgs) -> bool | None:
    """The explicit `async_scheduling`, or False where the engine cannot run it (so that the
    level's default applies only where it can; None: the level decides).

    Raises:
        ValueError: `async_scheduling=True` on an engine that cannot run it (names why).
    """
    blockers = async_scheduling_blockers(
        speculative=args.speculative_config is not None,
        kv_transfer=args.kv_transfer_config is not None,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        executor_backend=args.distributed_executor_backend,
        dp_lockstep=args.data_parallel_size > 1 and args.enable_expert_parallel,
    )
    if not blockers:
        return args.async_scheduling
    if args.async_scheduling:
        name, why = blockers[0]
        raise ValueError(
            f"async_scheduling=True cannot be combined with {name}={getattr(args, name)!r}: "
            f"{why}; leave async_scheduling unset or pass --no-async-scheduling"
        )
    return False


def _lora_config(args: EngineArgs) -> LoRAConfig | None:
    """The LoRA settings (None unless enable_lora); each start-up adapter is checked now, so a
    bad folder fails the start naming it."""
    lora_options = ("max_loras", "max_cpu_loras", "max_lora_rank", "lora_modules")
    if not args.enable_lora:
        defaults = EngineArgs()
        for name in lora_options:
            if getattr(args, name) != getattr(defaults, name):
                raise ValueError(f"{name} is a LoRA setting; it needs enable_lora=True")
        return None
    for name in ("tensor_parallel_size", "pipeline_parallel_size"):
        value = getattr(args, name)
        if value > 1:
            # NOTE: sharded LoRA (B split with column-parallel layers, A with row-parallel
            # ones, and the shrink all-gathered) is not built.
            raise ValueError(
                f"{name}={value} with enable_lora is not implemented yet; LoRA serving needs "
                f"{name}=1"
            )
    if args.speculative_config is not None:
        raise ValueError(
            "speculative_config with enable_lora is not implemented yet (drafts would run "
            "without the request's adapter); leave speculative_config unset"
        )
    config = LoRAConfig(
        max_loras=args.max_loras,
        max_cpu_loras=args.max_loras if args.max_cpu_loras is None else args.max_cpu_loras,
        max_lora_rank=args.max_lora_rank,
        lora_modules=parse_lora_modules(args.lora_modules),
    )
    for module in config.lora_modules:
        config.check_adapter(module.name, module.path)
    return config


def _layer_partition(args: EngineArgs, hf_config: dict[str, Any]) -> tuple[int, ...] | None:
    """The parsed partition, checked against the model's layers and the stage count."""
    from fleetserve.engine.distributed.stages import parse_layer_partition, stage_layer_range

    partition = parse_layer_partition(args.pipeline_layer_partition)
    num_layers = hf_config.get("num_hidden_layers")
    if isinstance(num_layers, int):
        stage_layer_range(num_layers, 0, args.pipeline_parallel_size, partition)
    elif partition is not None and len(partition) != args.pipeline_parallel_size:
        raise ValueError(
            f"pipeline_layer_partition must give {args.pipeline_parallel_size} stage(s), "
            f"got {list(partition)}"
        )
    return partition


def _speculative_config(
    data: dict[str, Any] | None,
    target_hf_config: dict[str, Any],
    max_model_len: int,
    kv_transfer: bool,
) -> SpeculativeConfig | None:
    """Parse `speculative_config`; a draft model must share the target's vocabulary (its token
    ids are verified by the target as they are)."""
    if data is None:
        return None
    spec = SpeculativeConfig.from_dict(data)
    if spec.method != "draft_model":
        return spec
    if kv_transfer:
        # NOTE: a remote prefill brings the target's KV only; the draft's would be missing.
        raise ValueError(
            "speculative_config method 'draft_model' with kv_transfer_config is not implemented "
            "(the draft model's KV of a remotely computed prompt is not transferred); use "
            "method 'ngram' on P/D engines"
        )
    assert spec.model is not None
    draft_config = load_hf_config(spec.model)
    draft_vocab = draft_config.get("vocab_size")
    if draft_vocab != target_hf_config.get("vocab_size"):
        raise ValueError(
            f"speculative_config.model must have the target's vocabulary "
            f"(vocab_size {target_hf_config.get('vocab_size')}), got vocab_size {draft_vocab}"
        )
    draft_limit = int(draft_config.get("max_position_embeddings", 2048))
    if draft_limit < max_model_len:
        raise ValueError(
            f"speculative_config.model must reach max_model_len ({max_model_len}) positions, "
            f"its max_position_embeddings is {draft_limit}"
        )
    return spec


def _quantization(args: EngineArgs, hf_config: dict[str, Any]) -> QuantizationConfig | None:
    quant = resolve_engine_quantization(args.quantization, args.quantization_config, hf_config)
    if quant is None:
        return None
    spec = args.speculative_config or {}
    if spec.get("method") == "draft_model":
        raise ValueError(
            "speculative_config method 'draft_model' with quantization is not implemented (the "
            "draft would be quantized by the target's layer patterns); use method 'ngram'"
        )
    if quant.checkpoint is not None and args.tensor_parallel_size > 1:
        raise ValueError(
            f"tensor_parallel_size={args.tensor_parallel_size} with a compressed-tensors "
            "checkpoint is not implemented yet; pre-quantized checkpoints load on one rank"
        )
    return quant


def _check_group_env(args: EngineArgs, env: Env) -> None:
    """The operator renders a pod's rank and its group's world size; they must agree with the
    parallel sizes, or the pod would wait for peers that never come."""
    world = args.tensor_parallel_size * args.pipeline_parallel_size * args.data_parallel_size
    if env.world_size is not None and env.world_size != world:
        raise ValueError(
            f"{env_name('world_size')}={env.world_size} does not match tensor × pipeline × data "
            f"parallel sizes ({args.tensor_parallel_size}×{args.pipeline_parallel_size}"
            f"×{args.data_parallel_size} = {world})"
        )
    if env.rank is not None and env.rank >= world:
        raise ValueError(f"{env_name('rank')}={env.rank} must be < the world size {world}")
    if args.data_parallel_size > 1 and env.group_size is not None and env.group_size > 1:
        raise ValueError(
            f"data_parallel_size={args.data_parallel_size} in a group of {env.group_size} pods "
            f"({env_name('group_size')}) is not implemented yet (issue 16): data-parallel ranks "
            "run in one pod, behind its one server"
        )


def _base_type(annotation: Any) -> type:
    args = [a for a in typing.get_args(annotation) if a is not types.NoneType]
    base = args[0] if args else annotation
    return typing.get_origin(base) or base


def _json_object(flag: str) -> Any:
    def parse(text: str) -> dict[str, Any]:
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"{flag} is not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise argparse.ArgumentTypeError(f"{flag} must be a JSON object")
        return value

    return parse
