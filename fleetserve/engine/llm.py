"""`LLM`: the offline API — the same EngineCore as the server, driven in-process."""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping, Sequence
from typing import Any, cast

from fleetserve.engine.chat import apply_chat_template
from fleetserve.engine.config import EngineConfig
from fleetserve.engine.core.engine_core import EngineCore
from fleetserve.engine.output_processor import OutputProcessor
from fleetserve.engine.request_output import RequestOutput
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.engine.tokenizer import encode_prompt, eos_token_ids, load_tokenizer
from fleetserve.engine.validation import validate_prompt

logger = logging.getLogger(__name__)

PromptType = str | Mapping[str, Any]
"""A prompt string, or {"prompt_token_ids": [...]} (optionally with "cache_salt")."""


class LLM:
    """Generate text from a Hugging Face model folder with continuous batching.

    Args mirror vLLM's `LLM` (see ARCHITECTURE.md §3); `model=None` uses the bundled
    SmolLM2-135M-Instruct. Extra scheduler knobs: `long_prefill_token_threshold`,
    `scheduling_policy` ('fcfs' | 'priority') and `full_sequence_must_fit`.
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        device: str = "auto",
        seed: int = 0,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        attention_backend: str = "auto",
        tensor_parallel_size: int = 1,
        pipeline_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        enable_eplb: bool = False,
        kv_transfer_config: dict[str, Any] | None = None,
        long_prefill_token_threshold: int = 0,
        scheduling_policy: str = "fcfs",
        full_sequence_must_fit: bool = False,
        gpu_memory_utilization: float = 0.9,
        custom_ops: str = "auto",
        enforce_eager: bool = False,
        load_format: str = "safetensors",
    ) -> None:
        if model is None:
            from fleetserve.engine.models.bundled import bundled_model_path

            model = str(bundled_model_path())
        self.config = EngineConfig.create(
            model,
            dtype=dtype,
            device=device,
            seed=seed,
            block_size=block_size,
            num_kv_blocks=num_kv_blocks,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=max_model_len,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            attention_backend=attention_backend,
            tensor_parallel_size=tensor_parallel_size,
            pipeline_parallel_size=pipeline_parallel_size,
            enable_expert_parallel=enable_expert_parallel,
            enable_eplb=enable_eplb,
            kv_transfer_config=kv_transfer_config,
            long_prefill_token_threshold=long_prefill_token_threshold,
            scheduling_policy=scheduling_policy,
            full_sequence_must_fit=full_sequence_must_fit,
            gpu_memory_utilization=gpu_memory_utilization,
            custom_ops=custom_ops,
            enforce_eager=enforce_eager,
            load_format=load_format,
        )
        self.tokenizer = load_tokenizer(model)
        self.eos_token_ids = eos_token_ids(model, self.config.model.hf_config, self.tokenizer)
        self.engine_core = EngineCore(self.config)
        self._processor = OutputProcessor(self.tokenizer)
        self._counter = itertools.count()

    # -- public API ---------------------------------------------------------------------------

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts.

        Raises:
            ValueError: an invalid prompt or sampling parameter (nothing is run then).
        """
        prompt_list = [prompts] if isinstance(prompts, str | Mapping) else list(prompts)
        params_list = _broadcast_params(sampling_params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError("priority must have one entry per prompt")
        # Validate everything first so an invalid prompt never leaves others half-submitted.
        encoded = [self._encode(p) for p in prompt_list]
        for (ids, _, _), params in zip(encoded, params_list, strict=True):
            validate_prompt(ids, params, self.config)
        request_ids = []
        for i, ((ids, text, salt), params) in enumerate(zip(encoded, params_list, strict=True)):
            request_ids.append(
                self.add_request(
                    ids,
                    params,
                    prompt=text,
                    cache_salt=salt,
                    priority=priority[i] if priority else 0,
                )
            )
        return self._run_until_done(request_ids)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies for one conversation or a list of conversations."""
        conversations = cast(
            "list[Sequence[Mapping[str, Any]]]",
            [messages] if messages and isinstance(messages[0], Mapping) else list(messages),
        )
        prompts: list[PromptType] = [
            {
                "prompt_token_ids": apply_chat_template(
                    self.tokenizer, conv, add_generation_prompt=add_generation_prompt
                )
            }
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params)

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        prompt: str | None = None,
        cache_salt: str | None = None,
        priority: int = 0,
    ) -> str:
        """Queue one request without running it (use `step`); returns its id."""
        validate_prompt(prompt_token_ids, params, self.config)
        request_id = request_id if request_id is not None else str(next(self._counter))
        children = self._processor.add_request(request_id, prompt, prompt_token_ids, params)
        for child_id, child in children.items():
            self.engine_core.add_request(
                child_id,
                prompt_token_ids,
                child,
                eos_token_ids=self.eos_token_ids,
                priority=priority,
                cache_salt=cache_salt,
            )
        return request_id

    def abort_request(self, request_id: str) -> None:
        self.engine_core.abort_requests(self._processor.abort_request(request_id))

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that finished in it."""
        processed = self._processor.process_outputs(self.engine_core.step())
        if processed.reqs_to_finish:
            self.engine_core.stop_requests(processed.reqs_to_finish)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.engine_core.has_unfinished_requests()

    def reset_prefix_cache(self) -> bool:
        return self.engine_core.reset_prefix_cache()

    # -- helpers ------------------------------------------------------------------------------

    def _encode(self, prompt: PromptType) -> tuple[list[int], str | None, str | None]:
        if isinstance(prompt, str):
            return encode_prompt(self.tokenizer, prompt), prompt, None
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            return list(ids), prompt.get("prompt"), prompt.get("cache_salt")
        if "prompt" in prompt:
            text = str(prompt["prompt"])
            return encode_prompt(self.tokenizer, text), text, prompt.get("cache_salt")
        raise ValueError("a prompt must be a string or a dict with 'prompt_token_ids' or 'prompt'")

    def _run_until_done(self, request_ids: list[str]) -> list[RequestOutput]:
        wanted = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        while wanted - finished.keys():
            if not self.engine_core.has_unfinished_requests():
                raise RuntimeError("engine has no work left but requests are unfinished")
            for output in self.step():
                if output.request_id in wanted:
                    finished[output.request_id] = output
        return [finished[rid] for rid in request_ids]


def _broadcast_params(
    params: SamplingParams | Sequence[SamplingParams] | None, count: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"sampling_params has {len(params)} entries for {count} prompts")
    return params
