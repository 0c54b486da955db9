"""The model runner: persistent batch + model + paged KV cache + sampler, one step at a time.

Lifecycle: `load_model()` → `determine_num_kv_blocks()` → `initialize_kv_cache(n)` →
`capture_cuda_graphs()` → per step `execute_model(scheduler_output)`. Each step (seed notes part 1
§2.15–2.16):

1. `_update_states`: drop finished requests (state deleted) and preempted ones (state kept, so a
   seeded generator continues when the request returns as new), zero freshly allocated blocks,
   add new requests, apply the deltas of cached ones, condense the batch.
2. `_prepare_inputs`: flat input ids, positions (num_computed_tokens + i), slot mapping
   (block_id * block_size + offset) and attention metadata, written into the persistent step
   buffers (pinned on CUDA) and copied to the device; a uniform decode batch is padded to a
   CUDA graph size when graphs are on.
3. forward under `torch.inference_mode()` (a graph replay for padded decode batches); logits only
   for requests whose every token is computed after this step (a prefill chunk that stops short
   samples nothing).
4. sample, append the sampled tokens to the requests' states, report them.
"""

from __future__ import annotations

import heapq
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.core.outputs import (
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
    concat_logprobs_rows,
)
from fleetserve.engine.layers.attention import AttentionMetadata, CudaGraphSupport
from fleetserve.engine.layers.sampler import (
    Sampler,
    SamplingMetadata,
    build_sampling_metadata,
    gather_logprobs,
)
from fleetserve.engine.models.interface import CausalLM
from fleetserve.engine.models.llama import head_size_of
from fleetserve.engine.models.loader import load_model, torch_dtype
from fleetserve.engine.worker.cuda_graphs import DecodeGraphs, cuda_graph_capture_sizes
from fleetserve.engine.worker.input_batch import CachedRequestState, InputBatch
from fleetserve.engine.worker.step_buffers import StepBuffers

logger = logging.getLogger(__name__)

_CUDA_RESERVE_BYTES = 512 << 20
"""Headroom left on the GPU for the allocator, kernels' workspaces and the logits."""

_PROMPT_LOGITS_ROWS = 256
"""Prompt positions whose logits are materialised at once (bounds rows x vocab floats)."""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class _StepInputs:
    req_ids: list[str]
    """Scheduled requests in row order (the order of the flat token dimension)."""
    input_ids: torch.Tensor  # [num_tokens] int64 (padded tokens included)
    positions: torch.Tensor  # [num_tokens] int64
    metadata: AttentionMetadata
    padded_size: int | None
    """The decode-graph size this batch was padded to, or None (runs eagerly, unpadded)."""
    sample_req_indices: list[int]
    """Indices into `req_ids` of the requests that sample this step."""
    logits_indices: torch.Tensor  # [num_sampling] int64, their last token in the flat batch


class ModelRunner:
    """Runs the model for one engine rank (single-rank for now)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.device = torch.device(config.device.device)
        self.dtype = torch_dtype(config.model.dtype)
        self.block_size = config.cache.block_size
        self.max_model_len = config.model.max_model_len
        hf_config = config.model.hf_config
        self.num_layers = int(hf_config["num_hidden_layers"])
        num_heads = int(hf_config["num_attention_heads"])
        self.num_kv_heads = int(hf_config.get("num_key_value_heads") or num_heads)
        self.head_size = head_size_of(hf_config)
        self.vocab_size = config.model.vocab_size
        self.max_num_blocks_per_req = _cdiv(self.max_model_len, self.block_size)
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = InputBatch(
            config.scheduler.max_num_seqs, self.max_model_len, self.max_num_blocks_per_req
        )
        default_generator = torch.Generator(device=self.device)
        default_generator.manual_seed(config.model.seed)
        self.sampler = Sampler(default_generator)
        self.model: CausalLM | None = None
        self.kv_caches: list[torch.Tensor] = []
        self.decode_graphs: DecodeGraphs | None = None
        """Set by `capture_cuda_graphs` (CUDA); tests may set a non-capturing one on the CPU."""
        max_graph_batch = cuda_graph_capture_sizes(config.scheduler.max_num_seqs)[-1]
        self.buffers = StepBuffers(
            max(config.scheduler.max_num_batched_tokens, max_graph_batch),
            config.scheduler.max_num_seqs,
            self.max_num_blocks_per_req,
            self.device,
        )

    # -- setup ---------------------------------------------------------------------------------

    def load_model(self) -> None:
        self.model = load_model(self.config)

    def get_kv_cache_block_bytes(self) -> int:
        """Bytes one KV block takes across all layers (keys and values)."""
        element_bytes = torch.empty((), dtype=self.dtype).element_size()
        per_layer = 2 * self.block_size * self.num_kv_heads * self.head_size * element_bytes
        return per_layer * self.num_layers

    def determine_num_kv_blocks(self) -> int:
        """KV blocks to allocate, including the null block 0.

        The configured `num_kv_blocks` wins; otherwise the CPU budget or the free GPU memory
        (after loading) sets it, capped at what max_num_seqs full-length requests can use.

        Raises:
            ValueError: the memory budget does not fit even two blocks.
        """
        if self.config.cache.num_kv_blocks is not None:
            return self.config.cache.num_kv_blocks
        block_bytes = self.get_kv_cache_block_bytes()
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = int(total * self.config.cache.gpu_memory_utilization) - used
            budget -= _CUDA_RESERVE_BYTES + self._activation_bytes()
        else:
            budget = self.config.cache.cpu_kv_cache_space_bytes
        num_blocks = budget // block_bytes
        needed = self.config.scheduler.max_num_seqs * self.max_num_blocks_per_req + 1
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
        hf_config = self.config.model.hf_config
        width = 6 * int(hf_config["hidden_size"]) + 3 * int(hf_config["intermediate_size"])
        element_bytes = torch.empty((), dtype=self.dtype).element_size()
        tokens = self.config.scheduler.max_num_batched_tokens
        logits = self.config.scheduler.max_num_seqs * self.vocab_size * 4 * 3
        return tokens * width * element_bytes + logits

    def initialize_kv_cache(self, num_blocks: int) -> None:
        """Allocate one zeroed [2, num_blocks, block_size, num_kv_heads, head_size] per layer."""
        shape = (2, num_blocks, self.block_size, self.num_kv_heads, self.head_size)
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)
        ]

    def cuda_graph_off_reason(self) -> str | None:
        """None when decode batches should be captured as CUDA graphs, else why not."""
        assert self.model is not None, "load_model() must run first"
        if self.device.type != "cuda":
            return f"device is {self.device.type!r}"
        if self.config.device.enforce_eager:
            return "enforce_eager is set"
        backend = self.model.attn_backend
        if backend.cuda_graph_support < CudaGraphSupport.UNIFORM_DECODE:
            return f"attention backend {backend.name!r} cannot be captured"
        return None

    def capture_cuda_graphs(self) -> int:
        """Capture one decode graph per size up to max_num_seqs (when graphs apply); returns
        how many were captured. Runs after the KV cache exists (graphs record its address)."""
        assert self.kv_caches, "initialize_kv_cache() must run before capture_cuda_graphs()"
        reason = self.cuda_graph_off_reason()
        if reason is not None:
            # NOTE: on the CPU there is nothing to say; on CUDA the reason matters.
            log = logger.debug if self.device.type == "cpu" else logger.info
            log("CUDA graphs off: %s", reason)
            return 0
        sizes = cuda_graph_capture_sizes(self.config.scheduler.max_num_seqs)
        self.decode_graphs = DecodeGraphs(sizes, capture=True)
        free_before = torch.cuda.mem_get_info(self.device)[0]
        started = time.perf_counter()
        with torch.inference_mode():
            self.decode_graphs.capture_all(self._padding_forward)
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

    def _padding_forward(self, size: int) -> Callable[[], torch.Tensor]:
        """A forward over `size` padding rows (what capture records before any request)."""
        self.buffers.wait_for_copies()
        self._write_padding(0, size)
        ids, positions, metadata = self._padded_device_inputs(size, [])
        self.buffers.record_copies()
        model = self.model
        assert model is not None
        return lambda: model(ids, positions, self.kv_caches, metadata)

    # -- step ----------------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; returns the sampled tokens of every scheduled request (maybe empty)."""
        assert self.model is not None, "load_model() must run before execute_model()"
        assert self.kv_caches, "initialize_kv_cache() must run before execute_model()"
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            return ModelRunnerOutput.empty()
        inputs = self._prepare_inputs(scheduler_output)
        model = self.model
        with torch.inference_mode():

            def forward() -> torch.Tensor:
                return model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.metadata)

            if inputs.padded_size is not None and self.decode_graphs is not None:
                hidden_states = self.decode_graphs.run(inputs.padded_size, forward)
            else:
                hidden_states = forward()
            sampled: list[list[int]] = [[] for _ in inputs.req_ids]
            logprobs: dict[str, LogprobsLists] = {}
            if inputs.sample_req_indices:
                logits = self.model.compute_logits(hidden_states[inputs.logits_indices])
                states = [self.requests[inputs.req_ids[i]] for i in inputs.sample_req_indices]
                output = self.sampler(logits, self._sampling_metadata(states))
                for row, (state, token_id) in enumerate(
                    zip(states, output.sampled_token_ids.tolist(), strict=True)
                ):
                    sampled[inputs.sample_req_indices[row]] = [int(token_id)]
                    self._append_token(state, int(token_id))
                    k = state.sampling_params.logprobs
                    if k is not None and output.logprobs is not None:
                        logprobs[state.req_id] = _logprobs_row(
                            output.logprobs, row, k, self.vocab_size
                        )
            prompt_logprobs = self._prompt_logprobs(inputs, hidden_states, scheduler_output)
        for req_id in inputs.req_ids:
            state = self.requests[req_id]
            state.num_computed_tokens += scheduler_output.num_scheduled_tokens[req_id]
            row = self.input_batch.req_id_to_index[req_id]
            self.input_batch.num_computed_tokens[row] = state.num_computed_tokens
        return ModelRunnerOutput(
            req_ids=inputs.req_ids,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    def _prompt_logprobs(
        self, inputs: _StepInputs, hidden_states: torch.Tensor, so: SchedulerOutput
    ) -> dict[str, LogprobsLists]:
        """Logprobs of each prompt token given the ones before it, for the prompt positions
        computed this step by requests that asked (`prompt_logprobs`); a position is reported
        once, even when preemption makes the prompt be computed again."""
        assert self.model is not None
        result: dict[str, LogprobsLists] = {}
        row = 0
        for req_id in inputs.req_ids:
            state = self.requests[req_id]
            num_scheduled = so.num_scheduled_tokens[req_id]
            chunk_row, row = row, row + num_scheduled
            k = state.sampling_params.prompt_logprobs
            if k is None:
                continue
            # Position p's logits give the probability of prompt token p + 1.
            start = state.num_computed_tokens
            first = max(start, state.num_prompt_logprobs)
            last = min(start + num_scheduled, len(state.prompt_token_ids) - 1)
            if first >= last:
                continue
            rows = torch.arange(chunk_row + first - start, chunk_row + last - start)
            targets = torch.tensor(state.prompt_token_ids[first + 1 : last + 1])
            pieces = []
            for i in range(0, len(rows), _PROMPT_LOGITS_ROWS):
                part = rows[i : i + _PROMPT_LOGITS_ROWS].to(self.device)
                logits = self.model.compute_logits(hidden_states[part])
                raw = torch.log_softmax(logits.to(torch.float32), dim=-1)
                target = targets[i : i + _PROMPT_LOGITS_ROWS].to(self.device)
                pieces.append(gather_logprobs(raw, target, k))
            merged = pieces[0]
            for piece in pieces[1:]:
                merged = concat_logprobs_rows(merged, piece)
            result[req_id] = merged
            state.num_prompt_logprobs = last
        return result

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        # NOTE: finished first: an aborted id may be resubmitted in the same step as a new request.
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
        for req_id in so.preempted_req_ids:
            batch.remove_request(req_id)
        if so.new_block_ids_to_zero:
            block_ids = torch.tensor(so.new_block_ids_to_zero, device=self.device)
            for kv_cache in self.kv_caches:
                kv_cache[:, block_ids] = 0
        for new in so.scheduled_new_reqs:
            batch.remove_request(new.req_id)
        batch.condense()
        for new in so.scheduled_new_reqs:
            state = self._new_request_state(new)
            self.requests[new.req_id] = state
            batch.add_request(state)
        cached = so.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            state.block_ids.extend(cached.new_block_ids[i])
            if req_id not in batch.req_id_to_index:
                batch.add_request(state)
            else:
                batch.append_block_ids(req_id, cached.new_block_ids[i])
                row = batch.req_id_to_index[req_id]
                batch.num_computed_tokens[row] = state.num_computed_tokens
            if cached.new_token_ids[i]:
                self._sync_tokens(state, cached.new_token_ids[i])

    def _new_request_state(self, new: NewRequestData) -> CachedRequestState:
        previous = self.requests.get(new.req_id)
        generator = previous.generator if previous is not None else None
        num_prompt_logprobs = previous.num_prompt_logprobs if previous is not None else 0
        seed = new.sampling_params.seed
        if generator is None and seed is not None:
            generator = torch.Generator(device=self.device)
            generator.manual_seed(seed)
        num_tokens = len(new.prompt_token_ids) + len(new.output_token_ids)
        return CachedRequestState(
            req_id=new.req_id,
            prompt_token_ids=list(new.prompt_token_ids),
            output_token_ids=list(new.output_token_ids),
            sampling_params=new.sampling_params,
            generator=generator,
            block_ids=list(new.block_ids),
            num_computed_tokens=new.num_computed_tokens,
            num_synced_tokens=num_tokens,
            eos_token_ids=new.eos_token_ids,
            num_prompt_logprobs=num_prompt_logprobs,
        )

    def _sync_tokens(self, state: CachedRequestState, new_token_ids: list[int]) -> None:
        """Adopt the scheduler's view: its tokens after the last sync replace ours."""
        base = state.num_synced_tokens
        assert base >= len(state.prompt_token_ids), "sync point inside the prompt"
        state.output_token_ids = state.output_token_ids[: base - len(state.prompt_token_ids)]
        state.output_token_ids.extend(new_token_ids)
        state.num_synced_tokens = state.num_tokens
        room = max(self.max_model_len - base, 0)
        self.input_batch.set_tokens(state.req_id, base, new_token_ids[:room])

    def _append_token(self, state: CachedRequestState, token_id: int) -> None:
        state.output_token_ids.append(token_id)
        # NOTE: a token past max_model_len is reported (the scheduler finishes the request with
        # 'length') but never computed, so it needs no row slot.
        if state.num_tokens <= self.max_model_len:
            self.input_batch.set_tokens(state.req_id, state.num_tokens - 1, [token_id])

    def _prepare_inputs(self, so: SchedulerOutput) -> _StepInputs:
        batch = self.input_batch
        scheduled = sorted(
            (r for r, n in so.num_scheduled_tokens.items() if n > 0),
            key=lambda r: batch.req_id_to_index[r],
        )
        num_reqs = len(scheduled)
        rows = np.array([batch.req_id_to_index[r] for r in scheduled], dtype=np.int64)
        query_lens = np.array([so.num_scheduled_tokens[r] for r in scheduled], dtype=np.int64)
        starts = batch.num_computed_tokens[rows].astype(np.int64)
        seq_lens = starts + query_lens
        assert (seq_lens <= batch.num_tokens[rows]).all(), "scheduled beyond the known tokens"
        cu_query = np.cumsum(query_lens)
        total = int(cu_query[-1])
        token_rows = np.repeat(rows, query_lens)
        offsets = np.arange(total) - np.repeat(cu_query - query_lens, query_lens)
        positions = np.repeat(starts, query_lens) + offsets
        block_ids = batch.block_table[token_rows, positions // self.block_size].astype(np.int64)

        buf = self.buffers
        buf.wait_for_copies()
        buf.input_ids.np[:total] = batch.token_ids[token_rows, positions]
        buf.positions.np[:total] = positions
        buf.slot_mapping.np[:total] = block_ids * self.block_size + positions % self.block_size
        buf.query_start_loc.np[0] = 0
        buf.query_start_loc.np[1 : num_reqs + 1] = cu_query
        buf.seq_lens.np[:num_reqs] = seq_lens
        buf.block_table.np[:num_reqs] = batch.block_table[rows]

        graphs = self.decode_graphs
        padded = graphs.padded_size(num_reqs, total == num_reqs) if graphs is not None else None
        if padded is not None:
            self._write_padding(num_reqs, padded)
            ids, pos, metadata = self._padded_device_inputs(padded, seq_lens.tolist())
        else:
            num_cols = _cdiv(int(seq_lens.max()), self.block_size)
            metadata = AttentionMetadata(
                num_actual_tokens=total,
                query_start_loc=buf.query_start_loc.to_device(num_reqs + 1),
                seq_lens=buf.seq_lens.to_device(num_reqs),
                max_query_len=int(query_lens.max()),
                max_seq_len=int(seq_lens.max()),
                block_table=buf.block_table.to_device(num_reqs)[:, :num_cols],
                slot_mapping=buf.slot_mapping.to_device(total),
                block_size=self.block_size,
                query_lens_cpu=query_lens.tolist(),
                seq_lens_cpu=seq_lens.tolist(),
                is_uniform_decode=total == num_reqs,
            )
            ids, pos = buf.input_ids.to_device(total), buf.positions.to_device(total)
        buf.record_copies()
        sample_idx = [i for i, row in enumerate(rows) if seq_lens[i] == batch.num_tokens[row]]
        return _StepInputs(
            req_ids=scheduled,
            input_ids=ids,
            positions=pos,
            metadata=metadata,
            padded_size=padded,
            sample_req_indices=sample_idx,
            logits_indices=torch.from_numpy(cu_query[sample_idx] - 1).to(self.device),
        )

    def _write_padding(self, start: int, end: int) -> None:
        """Rows start..end-1 (one token each) become inert: token 0 at position 0, length 1 in
        the null block 0, slot -1 (writes nothing); the real rows 0..start-1 are untouched."""
        buf = self.buffers
        buf.input_ids.np[start:end] = 0
        buf.positions.np[start:end] = 0
        buf.slot_mapping.np[start:end] = -1
        buf.query_start_loc.np[start + 1 : end + 1] = np.arange(start + 1, end + 1)
        buf.seq_lens.np[start:end] = 1
        buf.block_table.np[start:end, 0] = 0

    def _padded_device_inputs(
        self, size: int, real_seq_lens: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Device inputs of a padded uniform decode batch whose first rows are real.

        Launch geometry must depend on `size` alone (a graph replays it for any lengths), so the
        metadata's host-side maxima are the limits (query 1, sequence max_model_len) and the
        block table keeps its full width; the kernels stop at each row's own length.
        """
        buf = self.buffers
        num_padding = size - len(real_seq_lens)
        metadata = AttentionMetadata(
            num_actual_tokens=size,
            query_start_loc=buf.query_start_loc.to_device(size + 1),
            seq_lens=buf.seq_lens.to_device(size),
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_table=buf.block_table.to_device(size),
            slot_mapping=buf.slot_mapping.to_device(size),
            block_size=self.block_size,
            query_lens_cpu=[1] * size,
            seq_lens_cpu=[*real_seq_lens, *([1] * num_padding)],
            is_uniform_decode=True,
        )
        return buf.input_ids.to_device(size), buf.positions.to_device(size), metadata

    def _sampling_metadata(self, states: list[CachedRequestState]) -> SamplingMetadata:
        generators = {i: s.generator for i, s in enumerate(states) if s.generator is not None}
        return build_sampling_metadata(
            [s.sampling_params for s in states],
            [s.prompt_token_ids for s in states],
            [s.output_token_ids for s in states],
            generators,
            [s.eos_token_ids for s in states],
            self.vocab_size,
            self.device,
        )


def _logprobs_row(lists: LogprobsLists, row: int, k: int, vocab_size: int) -> LogprobsLists:
    """One request's row, cut to its own k (the batch computed the largest k asked for)."""
    token_ids, values = lists.logprob_token_ids[row], lists.logprobs[row]
    num_listed = len(token_ids) - 1
    if k != -1 and k < num_listed:
        if num_listed == vocab_size:
            # NOTE: a batch that asked for the whole vocabulary lists it in id order, not by rank.
            top = heapq.nlargest(k, zip(values[1:], token_ids[1:], strict=True))
            token_ids = [token_ids[0], *(t for _, t in top)]
            values = [values[0], *(v for v, _ in top)]
        else:
            token_ids, values = token_ids[: k + 1], values[: k + 1]
    return LogprobsLists(
        logprob_token_ids=[list(token_ids)],
        logprobs=[list(values)],
        sampled_token_ranks=[lists.sampled_token_ranks[row]],
    )
