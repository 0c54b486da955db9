"""The draft-model proposer: a small model of the target's vocabulary, with its own KV caches.

The draft's KV caches are a group of their own (seed notes part 3 §2.5): one cache per draft
layer, indexed by the target's block ids and slot mapping, so the scheduler allocates once for
both and never has to tell them apart. Dropping or rewriting draft KV therefore cannot touch the
target's caches.

Per step, after the target sampled:

1. catch-up: the draft runs over exactly the target's step inputs (prompt chunks, the real
   token, the verified drafts), writing its KV at the same slots; so every position the target
   has computed, the draft has too (prefix-cache hits included: both were written together);
2. k decode passes over the requests that sampled: the first feeds the token the target just
   produced, each later one the previous draft; each draws a draft from the draft's distribution
   q (its logits through the request's own processors and temperature / top-k / top-p; greedy
   requests: its argmax) and keeps q for the rejection sampler.

Draft KV written for drafts the target rejects sits in slots past the request's computed tokens:
the next steps rewrite it before anything reads it. The scheduler reserves k lookahead slots per
request for step 2 (`SpeculativeConfig.num_lookahead_tokens`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from fleetserve.engine.config import EngineConfig, SpeculativeConfig, load_hf_config
from fleetserve.engine.layers.attention.layer import attention_layers
from fleetserve.engine.layers.attention.metadata import build_attention_metadata
from fleetserve.engine.layers.forward_context import ForwardContext
from fleetserve.engine.layers.layer_context import LayerContext
from fleetserve.engine.layers.sampler import Sampler, build_sampling_metadata
from fleetserve.engine.models.arch import ModelArch
from fleetserve.engine.models.interface import CausalLM
from fleetserve.engine.models.loader import load_model
from fleetserve.engine.sampling_params import SAMPLING_EPS
from fleetserve.engine.worker.input_batch import CachedRequestState, InputBatch
from fleetserve.engine.worker.input_prep import StepInputs
from fleetserve.engine.worker.kv_zeroing import zero_kv_blocks


def draft_engine_config(config: EngineConfig, spec: SpeculativeConfig) -> EngineConfig:
    """The target's engine config with the draft's model folder and architecture."""
    assert spec.model is not None, "a draft_model config names its model"
    model = dataclasses.replace(
        config.model, model=spec.model, hf_config=load_hf_config(spec.model)
    )
    return dataclasses.replace(config, model=model, speculative=None)


def draft_kv_block_bytes(config: EngineConfig, element_bytes: int) -> int:
    """Bytes one KV block takes in the draft's caches (0 without a draft model)."""
    spec = config.speculative
    if spec is None or spec.method != "draft_model":
        return 0
    arch = ModelArch.from_hf_config(draft_engine_config(config, spec).model.hf_config)
    return 2 * config.cache.block_size * arch.kv_size * element_bytes * arch.num_hidden_layers


class DraftModelProposer:
    """Runs the draft model (see module doc).

    Args:
        config: the target's engine config (with `speculative.method == "draft_model"`).
        context: the layer context the target was built with (same dtype and device).
        sampler: the runner's sampler (draft draws use its probabilities and generators).
    """

    def __init__(self, config: EngineConfig, context: LayerContext, sampler: Sampler) -> None:
        spec = config.speculative
        assert spec is not None and spec.method == "draft_model"
        self.config = draft_engine_config(config, spec)
        self.arch = ModelArch.from_hf_config(self.config.model.hf_config)
        self.context = context
        self.sampler = sampler
        self.num_speculative_tokens = spec.num_speculative_tokens
        self.block_size = config.cache.block_size
        self.device = context.device
        self.model: CausalLM | None = None
        self.kv_caches: dict[str, torch.Tensor] = {}

    def load(self) -> None:
        self.model = load_model(self.config, self.arch, self.context)

    def bind_kv_caches(self, num_blocks: int) -> None:
        """Allocate the draft's own zeroed caches: `num_blocks` blocks, the target's ids."""
        assert self.model is not None, "load() must run before bind_kv_caches()"
        arch = self.arch
        shape = (2, num_blocks, self.block_size, arch.num_key_value_heads, arch.head_size)
        self.kv_caches = {
            layer.layer_name: torch.zeros(shape, dtype=self.context.dtype, device=self.device)
            for layer in attention_layers(self.model)
        }

    def zero_blocks(self, block_ids: list[int]) -> None:
        zero_kv_blocks(list(self.kv_caches.values()), block_ids)

    def catch_up(self, inputs: StepInputs) -> None:
        """Write the draft's KV for every token the target computed this step."""
        assert self.model is not None
        context = ForwardContext(inputs.metadata, self.kv_caches)
        self.model(inputs.input_ids, inputs.positions, context)

    def propose(
        self,
        batch: InputBatch,
        states: Sequence[CachedRequestState],
        max_drafts: Sequence[int],
    ) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Up to `max_drafts[i]` drafts for each request, and the distributions they came from.

        Every request's last token (the one the target just produced) has no KV yet; pass j
        feeds it (j = 0) or draft j - 1 at position num_tokens - 1 + j.
        """
        assert self.model is not None
        vocab_size = self.arch.vocab_size
        drafts: list[list[int]] = [[] for _ in states]
        probs: list[list[torch.Tensor]] = [[] for _ in states]
        rows = np.array([batch.req_id_to_index[s.req_id] for s in states], dtype=np.int64)
        last = [s.all_token_ids[-1] for s in states]
        for j in range(max(max_drafts, default=0)):
            active = [i for i, limit in enumerate(max_drafts) if j < limit]
            if not active:
                break
            positions = np.array([states[i].num_tokens - 1 + j for i in active], dtype=np.int64)
            block_table = batch.block_table[rows[active]]
            block_ids = block_table[np.arange(len(active)), positions // self.block_size]
            slots = block_ids.astype(np.int64) * self.block_size + positions % self.block_size
            num_cols = -(-int(positions.max() + 1) // self.block_size)
            metadata = build_attention_metadata(
                [1] * len(active),
                (positions + 1).tolist(),
                torch.from_numpy(np.ascontiguousarray(block_table[:, :num_cols])),
                torch.from_numpy(slots),
                self.block_size,
                self.device,
            )
            input_ids = torch.tensor([last[i] for i in active], device=self.device)
            hidden = self.model(
                input_ids,
                torch.from_numpy(positions).to(self.device),
                ForwardContext(metadata, self.kv_caches),
            )
            logits = self.model.compute_logits(hidden)
            active_states = [states[i] for i in active]
            # NOTE: the draft's logits go through the request's own processors (allowed ids,
            # logit_bias, penalties over outputs + drafts so far), as the target's will: a
            # draft the target can never pick would only be rejected.
            sampling = build_sampling_metadata(
                [s.sampling_params for s in active_states],
                [s.prompt_token_ids for s in active_states],
                [
                    s.output_token_ids + drafts[i]
                    for s, i in zip(active_states, active, strict=True)
                ],
                {r: s.generator for r, s in enumerate(active_states) if s.generator is not None},
                [s.eos_token_ids for s in active_states],
                vocab_size,
                self.device,
            )
            processed = self.sampler.apply_logits_processors(logits, sampling)
            greedy = processed.argmax(dim=-1)
            if sampling.all_greedy:
                tokens = greedy
                q = torch.nn.functional.one_hot(greedy, vocab_size).to(torch.float32)
            else:
                q = self.sampler.compute_probs(processed, sampling)
                drawn = self.sampler.sample_from_probs(q, sampling.generators)
                is_greedy = sampling.temperature < SAMPLING_EPS
                tokens = torch.where(is_greedy, greedy, drawn)
            for row, i in enumerate(active):
                token = int(tokens[row])
                drafts[i].append(token)
                probs[i].append(q[row])
                last[i] = token
        stacked = [
            torch.stack(p) if p else torch.empty(0, vocab_size, device=self.device) for p in probs
        ]
        return drafts, stacked
