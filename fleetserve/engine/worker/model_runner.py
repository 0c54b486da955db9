"""The model runner: persistent batch + model + paged KV cache + sampler, one step at a time.

Lifecycle (driven by the `Worker`): `load_model()` → `bind_kv_caches(caches)` →
`capture_decode_graphs(sizes)` (CUDA only) → per step `execute_model(scheduler_output)` →
`release()`. Each step (seed notes part 1 §2.15–2.16):

1. `_update_states`: drop finished requests (state deleted) and preempted ones (state kept, so a
   seeded generator continues when the request returns as new), zero freshly allocated blocks,
   add new requests, apply the deltas of cached ones, condense the batch.
2. input preparation (`input_prep.InputPreparer`): flat input ids, positions, slot mapping and
   attention metadata in the persistent step buffers, copied to the device; a uniform decode
   batch is padded to a CUDA graph size when graphs are on and the step has no KV hooks.
3. forward under `torch.inference_mode()` with the step's `ForwardContext` (a graph replay for
   padded decode batches); logits only for requests whose every token is computed after this step
   (a prefill chunk that stops short samples nothing).
4. sample, append the sampled tokens to the requests' states, report them (plus logprobs).
   Under speculative decoding (`spec_decode.decoder`) the scheduled drafts sit after each
   request's real tokens, every draft position gets a logits row, the rejection sampler keeps
   the accepted prefix plus one token, and the proposer drafts the next step's tokens.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.core.outputs import (
    LogprobsLists,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from fleetserve.engine.distributed.pipeline import PipelineStage
from fleetserve.engine.eplb.runner import create_eplb_state, eplb_step
from fleetserve.engine.eplb.state import EplbState
from fleetserve.engine.kv_transfer.connector_meta import P2PMetadata
from fleetserve.engine.layers.attention.layer import attention_layers
from fleetserve.engine.layers.forward_context import ForwardContext, KVLayerHooks
from fleetserve.engine.layers.layer_context import LayerContext
from fleetserve.engine.layers.sampler import (
    Sampler,
    SamplingMetadata,
    build_sampling_metadata,
    greedy_tokens,
    samples_by_argmax,
)
from fleetserve.engine.models.arch import ModelArch
from fleetserve.engine.models.interface import CausalLM
from fleetserve.engine.models.loader import load_model
from fleetserve.engine.spec_decode.decoder import SpecDecoder
from fleetserve.engine.structured_output.bitmask import batch_bitmask
from fleetserve.engine.structured_output.step_bitmask import GrammarBitmask
from fleetserve.engine.worker.cuda_graphs import DecodeGraphs, cuda_graph_capture_sizes
from fleetserve.engine.worker.input_batch import CachedRequestState, InputBatch
from fleetserve.engine.worker.input_prep import InputPreparer, StepInputs, cdiv
from fleetserve.engine.worker.kv_zeroing import zero_kv_blocks
from fleetserve.engine.worker.logprobs import logprobs_row, prompt_logprobs
from fleetserve.engine.worker.step_buffers import StepBuffers

if TYPE_CHECKING:
    from fleetserve.engine.kv_transfer.worker_role import P2PConnectorWorker
    from fleetserve.engine.lora.runner import LoRARunner


logger = logging.getLogger(__name__)


class ModelRunner:
    """Runs the model for one engine rank.

    Args:
        config: the engine configuration.
        arch: the model's typed architecture (built once by the worker).
        context: dtype, device, custom ops and parallel rank every layer is built with.
    """

    def __init__(self, config: EngineConfig, arch: ModelArch, context: LayerContext) -> None:
        self.config = config
        self.arch = arch
        self.layer_context = context
        self.device = context.device
        self.dtype = context.dtype
        self.block_size = config.cache.block_size
        self.max_model_len = config.model.max_model_len
        self.vocab_size = arch.vocab_size
        self.max_num_blocks_per_req = cdiv(self.max_model_len, self.block_size)
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = InputBatch(
            config.scheduler.max_num_seqs, self.max_model_len, self.max_num_blocks_per_req
        )
        default_generator = torch.Generator(device=self.device)
        default_generator.manual_seed(config.model.seed)
        self.sampler = Sampler(default_generator)
        self.spec: SpecDecoder | None = None
        """Speculative decoding (drafts written, verified and proposed each step), or None."""
        if config.speculative is not None:
            self.spec = SpecDecoder(config, context, self.sampler, self.vocab_size)
        self.model: CausalLM | None = None
        self.kv_caches: list[torch.Tensor] = []
        """One cache per attention layer, in layer order (allocated by the worker)."""
        self._kv_caches_by_layer: dict[str, torch.Tensor] = {}
        self.decode_graphs: DecodeGraphs | None = None
        """Set by `capture_decode_graphs` (CUDA); tests may set a non-capturing one on the CPU."""
        self.kv_hooks: KVLayerHooks | None = None
        """Per-layer KV connector hooks for the coming steps; while set, every step runs
        eagerly (see `fleetserve.engine.layers.forward_context`)."""
        self.pipeline: PipelineStage | None = None
        """This rank's pipeline stage hand-off (set by the worker with more than one stage)."""
        self.kv_connector: P2PConnectorWorker | None = None
        """The KV connector's worker role (set by the worker when the engine has one): told
        each step's metadata before the forward pass, polled after it, every step."""
        max_graph_batch = cuda_graph_capture_sizes(config.scheduler.max_num_seqs)[-1]
        self.buffers = StepBuffers(
            max(config.scheduler.max_num_batched_tokens, max_graph_batch),
            config.scheduler.max_num_seqs,
            self.max_num_blocks_per_req,
            self.device,
        )
        self.input_preparer = InputPreparer(
            self.buffers, self.block_size, self.max_model_len, self.device
        )
        self.eplb: EplbState | None = None
        """This rank's EPLB (engines with `enable_eplb`; built with the model)."""
        self.lora: LoRARunner | None = None
        """The adapters' wrapped layers and caches (set by `load_model` with LoRA on)."""

    # -- setup (called by the Worker) ----------------------------------------------------------

    def load_model(self) -> None:
        self.model = load_model(self.config, self.arch, self.layer_context)
        self.eplb = create_eplb_state(self.config, self.model, self.layer_context)
        if self.config.lora is not None:
            from fleetserve.engine.lora.runner import LoRARunner

            self.lora = LoRARunner(
                self.config.lora, self.model, self.buffers.input_ids.np.shape[0], self.device
            )
        if self.spec is not None:
            self.spec.load_model()

    def bind_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Adopt one KV cache per attention layer, in layer order (the model must be loaded).

        Raises:
            ValueError: the number of caches differs from the model's attention layers.
        """
        assert self.model is not None, "load_model() must run before bind_kv_caches()"
        names = [layer.layer_name for layer in attention_layers(self.model)]
        if len(names) != len(kv_caches):
            raise ValueError(
                f"kv_caches must hold one cache per attention layer ({len(names)}), "
                f"got {len(kv_caches)}"
            )
        self.kv_caches = list(kv_caches)
        self._kv_caches_by_layer = dict(zip(names, kv_caches, strict=True))
        if self.spec is not None:
            # NOTE: a draft model's caches are its own group, indexed by the same block ids.
            self.spec.bind_kv_caches(kv_caches[0].shape[1])

    def attention_layer_names(self) -> list[str]:
        """The attention layers' names, in layer order (how KV hooks name them)."""
        return list(self._kv_caches_by_layer)

    def warm_up_gemms(self) -> None:
        """Gather the small-row GEMMs' packed weights onto huge pages, and build the CPU GEMMs'
        oneDNN primitives for the row buckets a step can use (`fleetserve.engine.layers.gemm`,
        up to its `WARM_UP_MAX_ROWS`): the linear layers' up to the token budget, the LM head's
        up to the sampled rows of a full batch (larger ones are built when first used). Nothing
        to do on CUDA."""
        from fleetserve.engine.layers.gemm import DenseGemm, gather_small_panels, warm_up_gemms
        from fleetserve.engine.layers.vocab_parallel_embedding import ParallelLMHead
        from fleetserve.engine.worker.cpu_malloc import release_free_heap

        assert self.model is not None, "load_model() must run before warm_up_gemms()"
        scheduler = self.config.scheduler
        spec = self.config.speculative
        sampled_rows = scheduler.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))
        gemms: list[tuple[DenseGemm, int]] = []
        for module in self.model.modules():
            for owner in (module, getattr(module, "quant_method", None)):
                gemm = getattr(owner, "gemm", None)
                if isinstance(gemm, DenseGemm):
                    rows = scheduler.max_num_batched_tokens
                    if isinstance(module, ParallelLMHead):
                        rows = min(rows, sampled_rows)
                    gemms.append((gemm, rows))
        # NOTE: the originals it frees come partly from the heap, whose free memory the tuned
        # glibc keeps (cpu_malloc's trim threshold): it gives that back as it goes.
        gather_small_panels((gemm for gemm, _ in gemms), release=release_free_heap)
        warm_up_gemms(gemms)

    def warm_up_compiled(self) -> None:
        """Compile (or load from the cache) the torch.compile'd pieces now, with one forward of
        a dummy request in their compile range, so that no request's step waits on Inductor
        (after `bind_kv_caches`; nothing to do when the engine compiles nothing). The dummy
        request reads only the null block and writes no KV (its slots are -1)."""
        pieces = self.layer_context.pieces
        if pieces is None:
            return
        from fleetserve.engine.compilation.pieces import compile_counts
        from fleetserve.engine.layers.attention.metadata import build_attention_metadata

        n = pieces.min_tokens
        if n > self.config.scheduler.max_num_batched_tokens:
            logger.warning(
                "compile_min_tokens (%d) is above max_num_batched_tokens (%d): no step runs "
                "the compiled pieces",
                n,
                self.config.scheduler.max_num_batched_tokens,
            )
            return
        assert self.model is not None and self.kv_caches, "bind_kv_caches() must run first"
        block_size = self.config.cache.block_size
        metadata = build_attention_metadata(
            [n],
            [n],
            torch.zeros(1, -(-n // block_size), dtype=torch.int32),
            torch.full((n,), -1, dtype=torch.int64),
            block_size,
            self.device,
        )
        context = ForwardContext(metadata, self._kv_caches_by_layer, kv_hooks=None)
        # NOTE: made outside inference mode, as the step buffers are (dynamo guards on it).
        ids = torch.zeros(n, dtype=torch.int64, device=self.device)
        positions = torch.arange(n, device=self.device)
        before = compile_counts()
        with torch.inference_mode():
            self.model(ids, positions, context)
        pieces.log_warm_up(before)

    def capture_decode_graphs(self, sizes: tuple[int, ...]) -> None:
        """Capture one decode graph per size (CUDA; after `bind_kv_caches`, since graphs record
        the caches' addresses)."""
        assert self.kv_caches, "bind_kv_caches() must run before capture_decode_graphs()"
        self.decode_graphs = DecodeGraphs(sizes, capture=True)
        with torch.inference_mode():
            self.decode_graphs.capture_all(self._padding_forward)

    def release(self) -> None:
        """Drop the graphs, the model and the KV caches (their memory is freed once unused)."""
        if self.decode_graphs is not None:
            self.decode_graphs.clear()
            self.decode_graphs = None
        self.model = None
        self.kv_caches = []
        self._kv_caches_by_layer = {}

    def _padding_forward(self, size: int) -> Callable[[], torch.Tensor]:
        """A forward over `size` padding rows (what capture records before any request).

        Captured with no KV hooks: a graph replays device work only (hooked steps run eagerly).
        """
        inputs = self.input_preparer.padding_only(size)
        model = self.model
        assert model is not None
        context = ForwardContext(inputs.metadata, self._kv_caches_by_layer, kv_hooks=None)
        return lambda: model(inputs.input_ids, inputs.positions, context)

    def execute_dummy_batch(self) -> None:
        """One forward over a single padding row, sampling nothing: slot -1 writes no KV and
        the row reads only the null block, so no request's state changes. What an idle
        lockstep data-parallel rank runs so that its peers' collectives in the forward meet it.
        """
        assert self.model is not None, "load_model() must run before execute_dummy_batch()"
        with torch.inference_mode():
            self._padding_forward(1)()

    # -- step ----------------------------------------------------------------------------------

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step of the scheduled batch.

        Args:
            scheduler_output: this step's schedule: new and cached requests' deltas, tokens per
                request, finished/preempted ids and freshly allocated blocks to zero.

        Returns:
            The sampled token of every scheduled request that completed its known tokens (an
            empty list for a prefill chunk that stops short), plus the logprobs and prompt
            logprobs that were asked for; `ModelRunnerOutput.empty()` when nothing was scheduled.

        Side effects:
            updates the persistent batch and per-request states (finished requests forgotten,
            sampled tokens appended, computed counts advanced), writes this step's K/V into the
            caches, zeroes the new blocks, and advances the seeded generators that sampled.
        """
        assert self.model is not None, "load_model() must run before execute_model()"
        assert self.kv_caches, "bind_kv_caches() must run before execute_model()"
        connector = self.kv_connector
        if connector is not None:
            connector.start_step(_p2p_metadata(scheduler_output))
        # NOTE: new blocks are zeroed here, before any transfer into them can start (the
        # connector starts loads only after this, in end_step).
        self._update_states(scheduler_output)
        if scheduler_output.total_num_scheduled_tokens == 0:
            output = ModelRunnerOutput.empty()
        else:
            output = self._run(scheduler_output, connector)
            if self.eplb is not None:
                output.eplb_stats = eplb_step(self.eplb)
        if connector is not None:
            output.kv_connector_output = connector.end_step()
        return output

    def _run(
        self, scheduler_output: SchedulerOutput, connector: P2PConnectorWorker | None
    ) -> ModelRunnerOutput:
        """The forward pass and sampling of a step that computes tokens."""
        assert self.model is not None
        hooks = self.kv_hooks
        if connector is not None and connector.saves_this_step:
            hooks = connector
        drafts = scheduler_output.scheduled_spec_decode_tokens
        loras = {r: self.requests[r].lora_request for r in scheduler_output.num_scheduled_tokens}
        # NOTE: a step with adapters runs eagerly (graphs are captured without the LoRA term).
        uses_lora = self.lora is not None and self.lora.step_uses_lora(list(loras.values()))
        inputs = self.input_preparer.prepare(
            self.input_batch,
            scheduler_output.num_scheduled_tokens,
            self.decode_graphs if hooks is None and not uses_lora else None,
            {req_id: len(tokens) for req_id, tokens in drafts.items()},
        )
        if self.lora is not None:
            self.lora.prepare_step(
                [loras[r] for r in inputs.req_ids],
                [scheduler_output.num_scheduled_tokens[r] for r in inputs.req_ids],
            )
        model = self.model
        context = ForwardContext(inputs.metadata, self._kv_caches_by_layer, kv_hooks=hooks)
        with torch.inference_mode():

            def forward() -> torch.Tensor:
                return model(inputs.input_ids, inputs.positions, context)

            hidden_states: torch.Tensor | None
            if self.pipeline is not None:
                hidden_states = self.pipeline.run(
                    len(inputs.input_ids),
                    lambda sent: model(inputs.input_ids, inputs.positions, context, sent),
                )
            elif inputs.padded_size is not None and self.decode_graphs is not None:
                hidden_states = self.decode_graphs.run(inputs.padded_size, forward)
            else:
                hidden_states = forward()
            sampled: list[list[int]] = [[] for _ in inputs.req_ids]
            logprobs: dict[str, LogprobsLists] = {}
            prompt: dict[str, LogprobsLists] = {}
            # NOTE: only the last pipeline stage samples; the others learn the tokens from the
            # scheduler's deltas next step (`_sync_tokens`).
            if hidden_states is not None:
                sampled, logprobs = self._sample(
                    inputs, hidden_states, drafts, scheduler_output.grammar_bitmask
                )
                prompt = prompt_logprobs(
                    model,
                    hidden_states,
                    inputs.req_ids,
                    self.requests,
                    scheduler_output.num_scheduled_tokens,
                    self.device,
                )
        if hooks is connector and connector is not None:
            connector.wait_for_save()
        for req_id, tokens in zip(inputs.req_ids, sampled, strict=True):
            state = self.requests[req_id]
            # NOTE: rejected drafts are not computed: the next steps rewrite their slots.
            num_rejected = len(drafts[req_id]) + 1 - len(tokens) if req_id in drafts else 0
            state.num_computed_tokens += (
                scheduler_output.num_scheduled_tokens[req_id] - num_rejected
            )
            row = self.input_batch.req_id_to_index[req_id]
            self.input_batch.num_computed_tokens[row] = state.num_computed_tokens
        spec_token_ids: dict[str, list[int]] = {}
        if self.spec is not None:
            sampled_states = [self.requests[inputs.req_ids[i]] for i in inputs.sample_req_indices]
            with torch.inference_mode():
                spec_token_ids = self.spec.propose(self.input_batch, inputs, sampled_states)
        return ModelRunnerOutput(
            req_ids=inputs.req_ids,
            sampled_token_ids=sampled,
            logprobs=logprobs,
            prompt_logprobs=prompt,
            spec_token_ids=spec_token_ids,
        )

    def _sample(
        self,
        inputs: StepInputs,
        hidden_states: torch.Tensor,
        drafts: dict[str, list[int]],
        grammar_bitmask: GrammarBitmask | None = None,
    ) -> tuple[list[list[int]], dict[str, LogprobsLists]]:
        """Sample the requests that complete their tokens; append each token to its state.

        With drafts (speculative decoding) a request gets its accepted drafts and one token of
        the target's, all appended."""
        assert self.model is not None
        sampled: list[list[int]] = [[] for _ in inputs.req_ids]
        logprobs: dict[str, LogprobsLists] = {}
        if not inputs.sample_req_indices:
            return sampled, logprobs
        if inputs.logits_rows_lead:
            # NOTE: a view instead of a gather: one op and a copy less a decode step.
            rows = hidden_states[: len(inputs.logits_indices)]
        else:
            rows = hidden_states[inputs.logits_indices]
        logits = self.model.compute_logits(rows)
        states = [self.requests[inputs.req_ids[i]] for i in inputs.sample_req_indices]
        if any(inputs.num_draft_tokens):
            assert self.spec is not None, "drafts scheduled without speculative decoding"
            request_drafts = [drafts.get(state.req_id, []) for state in states]
            tokens, logprobs = self.spec.verify(logits, states, request_drafts, grammar_bitmask)
            for index, state, token_ids in zip(
                inputs.sample_req_indices, states, tokens, strict=True
            ):
                sampled[index] = token_ids
                for token_id in token_ids:
                    self._append_tokens([state], [token_id])
            return sampled, logprobs
        output = None
        if grammar_bitmask is None and all(state.by_argmax for state in states):
            # NOTE: what the sampler would compute for these rows, without building its
            # per-row metadata (about 100 us a step at 64 rows on the CPU).
            token_ids = greedy_tokens(logits).tolist()
        else:
            metadata = self._sampling_metadata(states)
            metadata.grammar_bitmask = batch_bitmask(
                grammar_bitmask, [s.req_id for s in states], self.device
            )
            output = self.sampler(logits, metadata)
            token_ids = output.sampled_token_ids.tolist()
        self._append_tokens(states, token_ids)
        for row, (state, token_id) in enumerate(zip(states, token_ids, strict=True)):
            sampled[inputs.sample_req_indices[row]] = [token_id]
            k = state.sampling_params.logprobs
            if k is not None and output is not None and output.logprobs is not None:
                logprobs[state.req_id] = logprobs_row(output.logprobs, row, k, self.vocab_size)
        return sampled, logprobs

    def _update_states(self, so: SchedulerOutput) -> None:
        batch = self.input_batch
        # NOTE: finished first: an aborted id may be resubmitted in the same step as a new request.
        for req_id in so.finished_req_ids:
            self.requests.pop(req_id, None)
            batch.remove_request(req_id)
        for req_id in so.preempted_req_ids:
            batch.remove_request(req_id)
        if so.new_block_ids_to_zero:
            zero_kv_blocks(self.kv_caches, so.new_block_ids_to_zero)
            if self.spec is not None:
                self.spec.zero_blocks(so.new_block_ids_to_zero)
        for new in so.scheduled_new_reqs:
            batch.remove_request(new.req_id)
        batch.condense()
        for new in so.scheduled_new_reqs:
            state = self._new_request_state(new)
            self.requests[new.req_id] = state
            batch.add_request(state)
        cached = so.scheduled_cached_reqs
        # NOTE: tokens come only to the stages of a pipeline before the last (`step_deltas`).
        token_deltas = cached.new_token_ids or None
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests[req_id]
            state.num_computed_tokens = cached.num_computed_tokens[i]
            state.block_ids.extend(cached.new_block_ids[i])
            if req_id not in batch.req_id_to_index:
                batch.add_request(state)
            else:
                if cached.new_block_ids[i]:
                    batch.append_block_ids(req_id, cached.new_block_ids[i])
                row = batch.req_id_to_index[req_id]
                batch.num_computed_tokens[row] = state.num_computed_tokens
            if token_deltas is not None and token_deltas[i]:
                self._sync_tokens(state, token_deltas[i])
        if self.spec is not None:
            for req_id in (*so.finished_req_ids, *so.preempted_req_ids):
                self.spec.forget(req_id)
            self.spec.write_drafts(batch, self.requests, so.scheduled_spec_decode_tokens)

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
            lora_request=new.lora_request,
            by_argmax=samples_by_argmax(new.sampling_params),
        )

    def _sync_tokens(self, state: CachedRequestState, new_token_ids: list[int]) -> None:
        """Adopt the scheduler's view: its tokens after the last sync replace ours.

        When ours already start with them (this runner sampled them), ours are kept, also
        those past them: under async scheduling the scheduler learns a token one step after
        the runner, which meanwhile sampled the next one (the next step's input).
        """
        base = state.num_synced_tokens
        assert base >= len(state.prompt_token_ids), "sync point inside the prompt"
        offset = base - len(state.prompt_token_ids)
        if state.output_token_ids[offset : offset + len(new_token_ids)] == new_token_ids:
            state.num_synced_tokens = base + len(new_token_ids)
            return
        state.output_token_ids = state.output_token_ids[: base - len(state.prompt_token_ids)]
        state.output_token_ids.extend(new_token_ids)
        state.num_synced_tokens = state.num_tokens
        room = max(self.max_model_len - base, 0)
        self.input_batch.set_tokens(state.req_id, base, new_token_ids[:room])

    def _append_tokens(self, states: list[CachedRequestState], token_ids: list[int]) -> None:
        """Append token i to states[i] and to its row of the batch, the rows written at once
        (a `set_tokens` per request cost a 64-request decode step about 0.1 ms). Each state
        appears once: a request's several tokens (accepted drafts) take a call each."""
        rows: list[int] = []
        positions: list[int] = []
        kept: list[int] = []
        index = self.input_batch.req_id_to_index
        for state, token_id in zip(states, token_ids, strict=True):
            state.output_token_ids.append(token_id)
            # NOTE: a token past max_model_len is reported (the scheduler finishes the request
            # with 'length') but never computed, so it needs no row slot.
            if state.num_tokens <= self.max_model_len:
                rows.append(index[state.req_id])
                positions.append(state.num_tokens - 1)
                kept.append(token_id)
        self.input_batch.set_last_tokens(rows, positions, kept)

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


def _p2p_metadata(scheduler_output: SchedulerOutput) -> P2PMetadata | None:
    meta = scheduler_output.kv_connector_metadata
    return meta if isinstance(meta, P2PMetadata) else None
