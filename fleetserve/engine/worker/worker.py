"""The Worker: one rank's device, model, KV cache and model runner.

Lifecycle, driven by an `Executor` (usually through `collective_rpc`, so that every rank runs
the same sequence):

    init_device()              select the device; build the layer context and the runner
    load_model()               weights onto the device
    determine_num_kv_blocks()  what fits this rank's memory (the executor takes the minimum)
    initialize_kv_cache(n)     allocate n blocks per layer, zeroed; bind them to the runner
    capture_cuda_graphs()      decode graphs when they apply (CUDA, not enforce_eager, ...)
    execute_model(so)          per step
    shutdown()                 release graphs, model and caches

Sizing lives here, not in the runner, because under tensor or pipeline parallelism every rank
sizes its own memory and the executor must agree on one number for all of them. A rank's KV
cache holds only its own KV heads (`num_kv_heads_per_rank`).

With more than one rank, `init_device` joins the engine's process groups
(`fleetserve.engine.distributed.ParallelState`) at `distributed_init_method`, and `shutdown`
tears them down after the model is released.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import torch

from fleetserve.engine.compilation.levels import lower_level_hint
from fleetserve.engine.config import EngineConfig
from fleetserve.engine.core.outputs import ModelRunnerOutput, SchedulerOutput
from fleetserve.engine.distributed.data_parallel_sync import DPStepSync
from fleetserve.engine.distributed.parallel_state import ParallelState, layout_of
from fleetserve.engine.distributed.pipeline import PipelineStage
from fleetserve.engine.distributed.stages import stage_layer_range
from fleetserve.engine.layers.attention.base import CudaGraphSupport
from fleetserve.engine.layers.layer_context import LayerContext
from fleetserve.engine.layers.linear import num_kv_heads_per_rank
from fleetserve.engine.models.arch import ModelArch
from fleetserve.engine.models.loader import build_layer_context, torch_dtype
from fleetserve.engine.spec_decode.draft_model import draft_kv_block_bytes
from fleetserve.engine.worker.cuda_graphs import cuda_graph_capture_sizes
from fleetserve.engine.worker.input_prep import cdiv
from fleetserve.engine.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from fleetserve.engine.kv_transfer.scheduler_role import EngineIdentity
    from fleetserve.engine.kv_transfer.stats import KVTransferStats
    from fleetserve.engine.kv_transfer.transport import SharedKVArena
    from fleetserve.engine.kv_transfer.worker_role import P2PConnectorWorker

logger = logging.getLogger(__name__)

_CUDA_RESERVE_BYTES = 512 << 20
"""Headroom left on the GPU for the allocator, kernels' workspaces and the logits."""


class Worker:
    """One engine rank.

    Args:
        config: the engine configuration.
        rank: this worker's global rank in the engine's world.
        distributed_init_method: the process groups' rendezvous (e.g. 'tcp://127.0.0.1:29500');
            required with more than one rank.

    Raises:
        ValueError: the model's config.json does not describe a usable architecture, or a
            multi-rank topology without a rendezvous.
    """

    def __init__(
        self, config: EngineConfig, *, rank: int = 0, distributed_init_method: str | None = None
    ) -> None:
        if config.parallel.world_size_across_dp > 1 and distributed_init_method is None:
            raise ValueError("distributed_init_method is required with more than one rank")
        self.config = config
        self.rank = rank
        self.distributed_init_method = distributed_init_method
        self.parallel_state: ParallelState | None = None
        """This rank's process groups (None with one rank)."""
        self.pp_rank = layout_of(config.parallel).group_of("pipeline", rank).index(rank)
        """This rank's pipeline stage (from the rank layout, before any group exists)."""
        self.arch = ModelArch.from_hf_config(config.model.hf_config)
        """The typed architecture, read once for this rank's model and runner."""
        self.dtype = torch_dtype(config.model.dtype)
        self.device = torch.device(config.device.device)
        self.layer_context: LayerContext | None = None
        self._runner: ModelRunner | None = None
        self.kv_connector: P2PConnectorWorker | None = None
        """The KV connector's worker role, when the engine transfers KV (built in init_device)."""
        self._kv_arena: SharedKVArena | None = None
        self.dp_sync: DPStepSync | None = None
        """Lockstep data parallel: the per-forward agreement with the other DP ranks."""

    @property
    def model_runner(self) -> ModelRunner:
        """The runner (exists from `init_device` until `shutdown`)."""
        assert self._runner is not None, "init_device() must run first (and not shutdown())"
        return self._runner

    # -- lifecycle -----------------------------------------------------------------------------

    def init_device(self) -> None:
        """Select this rank's device and build the layer context and the model runner.

        Raises:
            ValueError: CUDA requested without a CUDA device, or custom ops the device cannot run.
        """
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("device 'cuda' needs a CUDA GPU, and torch sees none")
            # NOTE: the local rank picks the device; ranks of other hosts reuse indices.
            torch.cuda.set_device(self.rank % torch.cuda.device_count())
            self.device = torch.device("cuda", torch.cuda.current_device())
        parallel = self.config.parallel
        tp_group = None
        # NOTE: lockstep data-parallel ranks share one world (`world_size_across_dp`); an
        # independent replica's config has data_parallel_size 1.
        if parallel.world_size_across_dp > 1:
            assert self.distributed_init_method is not None
            self.parallel_state = ParallelState.create(
                parallel, rank=self.rank, init_method=self.distributed_init_method,
                device=self.device, custom_all_reduce=not parallel.disable_custom_all_reduce,
            )  # fmt: skip
            if parallel.tensor_parallel_size > 1:
                tp_group = self.parallel_state.tensor
            if parallel.needs_dp_lockstep:
                self.dp_sync = DPStepSync(self.parallel_state.data)
        pp_group = None if self.parallel_state is None else self.parallel_state.pipeline
        ep_group = None if self.parallel_state is None else self.parallel_state.expert
        self.layer_context = build_layer_context(
            self.config,
            tp_group=tp_group,
            pp_rank=self.pp_rank,
            ep_group=None if ep_group is None or ep_group.world_size == 1 else ep_group,
        )
        if self.dp_sync is not None:
            self.layer_context = dataclasses.replace(self.layer_context, dp_sync=self.dp_sync)
        self._runner = ModelRunner(self.config, self.arch, self.layer_context)
        if pp_group is not None and pp_group.world_size > 1:
            self._runner.pipeline = PipelineStage(
                pp_group, self.arch.hidden_size, self.dtype, self.device
            )
        if self.config.kv_transfer is not None:
            from fleetserve.engine.kv_transfer.factory import create_worker_role
            from fleetserve.engine.kv_transfer.rank_group import TensorRanks

            ranks = None if tp_group is None else TensorRanks(tp_group)
            self.kv_connector = create_worker_role(self.config, ranks)

    def load_model(self) -> None:
        self.model_runner.load_model()

    def get_kv_cache_block_bytes(self) -> int:
        """Bytes one KV block takes across all layers (keys and values)."""
        element_bytes = torch.empty((), dtype=self.dtype).element_size()
        arch = self.arch
        kv_size = self._num_kv_heads * arch.head_size
        per_layer = 2 * self.config.cache.block_size * kv_size * element_bytes
        # NOTE: a draft model's own caches take the same block ids (speculative decoding).
        draft = draft_kv_block_bytes(self.config, element_bytes)
        return per_layer * self._num_layers + draft

    @property
    def _num_layers(self) -> int:
        """Decoder layers this rank's pipeline stage holds (and caches KV for)."""
        parallel = self.config.parallel
        start, end = stage_layer_range(
            self.arch.num_hidden_layers,
            self.pp_rank,
            parallel.pipeline_parallel_size,
            parallel.pipeline_layer_partition,
        )
        return end - start

    @property
    def _num_kv_heads(self) -> int:
        """KV heads this rank caches (its share; one when they are replicated)."""
        return num_kv_heads_per_rank(
            self.arch.num_key_value_heads, self.config.parallel.tensor_parallel_size
        )

    def determine_num_kv_blocks(self) -> int:
        """KV blocks this rank can hold, including the null block 0 (after `load_model`).

        The configured `num_kv_blocks` wins; otherwise the CPU budget or the free GPU memory
        (after loading) sets it, capped at what max_num_seqs full-length requests can use.

        Raises:
            ValueError: the memory budget does not fit even two blocks.
        """
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        block_bytes = self.get_kv_cache_block_bytes()
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * cache.gpu_memory_utilization) - used
            budget -= _CUDA_RESERVE_BYTES + self._activation_bytes()
        else:
            budget = cache.cpu_kv_cache_space_bytes
        num_blocks = budget // block_bytes
        max_blocks_per_req = cdiv(self.config.model.max_model_len, cache.block_size)
        needed = self.config.scheduler.max_num_seqs * max_blocks_per_req + 1
        num_blocks = min(num_blocks, needed)
        if num_blocks < 2:
            raise ValueError(
                f"the KV cache budget ({budget} bytes) holds fewer than 2 blocks of "
                f"{block_bytes} bytes; raise gpu_memory_utilization / cpu_kv_cache_space_bytes "
                "or set num_kv_blocks"
            )
        return int(num_blocks)

    def _activation_bytes(self) -> int:
        """Rough peak of one step's activations (NOTE: an estimate, not a profiling run)."""
        width = 6 * self.arch.hidden_size + 3 * self.arch.intermediate_size
        element_bytes = torch.empty((), dtype=self.dtype).element_size()
        scheduler = self.config.scheduler
        logits = scheduler.max_num_seqs * self.arch.vocab_size * 4 * 3
        return scheduler.max_num_batched_tokens * width * element_bytes + logits

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate one zeroed [2, num_blocks, block_size, num_kv_heads, head_size] per layer and
        hand them to the runner."""
        arch = self.arch
        block_size = self.config.cache.block_size
        shape = (2, num_blocks, block_size, self._num_kv_heads, arch.head_size)
        connector = self.kv_connector
        if connector is not None and connector.wants_shared_memory and self.device.type == "cpu":
            # NOTE: a same-host peer then copies our blocks with one memcpy per run instead of
            # a socket round trip (the tcp transport's fast path); the tensors are zeroed.
            from fleetserve.engine.kv_transfer.transport import SharedKVArena

            self._kv_arena = SharedKVArena.create([shape] * self._num_layers, self.dtype)
            kv_caches = list(self._kv_arena.tensors)
        else:
            kv_caches = [
                torch.zeros(shape, dtype=self.dtype, device=self.device)
                for _ in range(self._num_layers)
            ]
        self.model_runner.bind_kv_caches(kv_caches)
        self.model_runner.warm_up_gemms()
        self.model_runner.warm_up_compiled()
        if connector is not None:
            names = self.model_runner.attention_layer_names()
            connector.register_kv_caches(kv_caches, layer_names=names, shared=self._kv_arena)
            self.model_runner.kv_connector = connector

    def kv_connector_stats(self) -> KVTransferStats | None:
        """The connector's counters (and the transfer observations since the last call)."""
        return None if self.kv_connector is None else self.kv_connector.stats.take()

    def wait_for_kv_progress(self, timeout_s: float) -> None:
        """Sleep until a KV transfer may advance, at most `timeout_s` (the engine loop calls
        this between steps that only poll transfers)."""
        if self.kv_connector is None:
            time.sleep(timeout_s)
        else:
            self.kv_connector.wait_for_progress(timeout_s)

    def kv_connector_identity(self) -> EngineIdentity | None:
        """How other engines reach this engine's connector (None without one)."""
        return None if self.kv_connector is None else self.kv_connector.identity()

    def cuda_graph_off_reason(self) -> str | None:
        """None when decode batches should be captured as CUDA graphs, else why not.

        NOTE: the user's explicit choice is checked first, so that it is the reason reported
        (and observable) on every device, the CPU included.
        """
        if self.config.device.enforce_eager:
            return "enforce_eager is set"
        if self.config.parallel.world_size_across_dp > 1:
            # NOTE: captured collectives need registered buffers (seed part 2 §2.5); not built.
            return "more than one rank (graphs with collectives are not built yet)"
        if self.device.type != "cuda":
            return f"device is {self.device.type!r}"
        model = self.model_runner.model
        assert model is not None, "load_model() must run first"
        if getattr(model, "moe_layers", None) is not None:
            # NOTE: both MoE paths read each step's per-expert token counts on the host.
            return "MoE layers size their expert segments on the host (not capturable yet)"
        backend = model.attn_backend
        if backend.cuda_graph_support < CudaGraphSupport.UNIFORM_DECODE:
            return f"attention backend {backend.name!r} cannot be captured"
        return None

    def capture_cuda_graphs(self) -> int:
        """Capture one decode graph per size up to max_num_seqs when graphs apply; returns how
        many were captured (0 when off). Runs after `initialize_kv_cache`."""
        reason = self.cuda_graph_off_reason()
        if reason is not None:
            # NOTE: on the CPU there is nothing to say; on CUDA the reason matters.
            log = logger.debug if self.device.type == "cpu" else logger.info
            log("CUDA graphs off: %s", reason)
            return 0
        sizes = cuda_graph_capture_sizes(self.config.scheduler.max_num_seqs)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        started = time.perf_counter()
        try:
            self.model_runner.capture_decode_graphs(sizes)
        except RuntimeError as exc:
            level = self.config.device.optimization_level
            raise RuntimeError(f"{lower_level_hint(level, 'CUDA graph capture')}: {exc}") from exc
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info(
            "captured %d CUDA graphs (decode batches %d..%d) in %.1f s using %.0f MiB",
            len(sizes),
            sizes[0],
            sizes[-1],
            time.perf_counter() - started,
            used / (1 << 20),
        )
        return len(sizes)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """One step on this rank (see `ModelRunner.execute_model`).

        In lockstep data parallel every call runs exactly one forward, a dummy one when the
        step computes no token, after agreeing with the other DP ranks (`DPStepSync`).
        """
        if self.dp_sync is None:
            return self.model_runner.execute_model(scheduler_output)
        num_tokens = scheduler_output.total_num_scheduled_tokens
        # NOTE: a step without tokens runs the dummy forward's one padding row instead.
        self.dp_sync.sync(num_tokens or 1)
        output = self.model_runner.execute_model(scheduler_output)
        if num_tokens == 0:
            self.model_runner.execute_dummy_batch()
        return output

    def execute_dummy_batch(self) -> None:
        """Lockstep data parallel: the forward of a rank without work this step (one padding
        row that touches no request's KV), so that the other ranks' collectives meet it.

        Raises:
            RuntimeError: the engine is not a lockstep data-parallel rank.
        """
        if self.dp_sync is None:
            raise RuntimeError("execute_dummy_batch is for lockstep data-parallel ranks only")
        self.dp_sync.sync(1)  # the dummy forward's one padding row
        self.model_runner.execute_dummy_batch()

    def moe_expert_slots(self) -> list[list[int]]:
        """Per MoE layer of this rank (layer order), the physical expert slots it holds
        (empty for a dense model)."""
        model = self.model_runner.model
        layers = getattr(model, "moe_layers", None)
        return [] if layers is None else [list(m.local_physical_experts) for m in layers()]

    def shutdown(self) -> None:
        """Release the graphs, the model and the KV caches; the runner is gone afterwards.

        Idempotent; the process may keep running (memory returns once nothing else holds it).
        """
        if self._runner is not None:
            self._runner.release()
            self._runner = None
        if self.kv_connector is not None:
            self.kv_connector.close()
            self.kv_connector = None
        if self._kv_arena is not None:
            self._kv_arena.close()
            self._kv_arena = None
        if self.parallel_state is not None:
            self.parallel_state.destroy()
            self.parallel_state = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
