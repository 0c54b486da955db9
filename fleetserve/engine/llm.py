"""`LLM`: the offline API — the same EngineCore as the server, driven in-process."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import logging
import typing
from collections.abc import Callable, Mapping, Sequence
from typing import Any, cast

from fleetserve.engine.arg_utils import EngineArgs
from fleetserve.engine.chat import apply_chat_template
from fleetserve.engine.core.engine_core import EngineCore
from fleetserve.engine.lora.request import LoRARequest
from fleetserve.engine.output_processor import OutputProcessor
from fleetserve.engine.request_output import RequestOutput
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.engine.tokenizer import encode_prompt, eos_token_ids, load_tokenizer
from fleetserve.engine.validation import validate_prompt, validate_without_tokenizer

logger = logging.getLogger(__name__)

PromptType = str | Mapping[str, Any]
"""A prompt string, or {"prompt_token_ids": [...]} (optionally with "cache_salt")."""


class LLM:
    """Generate text from a Hugging Face model folder with continuous batching.

    The keywords are the fields of `EngineArgs` (vLLM's names: `dtype`, `block_size`,
    `max_num_seqs`, `enable_prefix_caching`, ...; `inspect.signature(LLM)` lists them), the same
    options `fleetserve serve` takes as flags; `model=None` uses the bundled SmolLM2-135M-Instruct.

    Raises:
        ValueError: an unknown keyword, a bad value, or an option this build does not implement.
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        args = EngineArgs.from_kwargs(model=model, **kwargs)
        self.config = args.create_engine_config()
        model = self.config.model.model
        # NOTE: with skip_tokenizer_init prompts and outputs are token ids only (vLLM's option).
        self.tokenizer = None if args.skip_tokenizer_init else load_tokenizer(model)
        self.eos_token_ids = eos_token_ids(model, self.config.model.hf_config, self.tokenizer)
        self.engine_core = EngineCore(self.config)
        self._processor = OutputProcessor(self.tokenizer)
        self._counter = itertools.count()

    # -- public API ---------------------------------------------------------------------------

    def get_default_sampling_params(self) -> SamplingParams:
        """`SamplingParams` with the `--generation-config` defaults (what `generate` uses when
        given none)."""
        return SamplingParams(**self.config.generation.overrides())

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        priority: Sequence[int] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of the prompts.

        `lora_request` runs every prompt (or, as a list, each prompt) under that adapter
        (None: the base model); it needs an engine built with enable_lora.

        Raises:
            ValueError: an invalid prompt or sampling parameter (nothing is run then).
        """
        prompt_list = [prompts] if isinstance(prompts, str | Mapping) else list(prompts)
        params_list = _broadcast_params(
            sampling_params, len(prompt_list), self.get_default_sampling_params
        )
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError("priority must have one entry per prompt")
        loras = _broadcast_lora(lora_request, len(prompt_list))
        # Validate everything first so an invalid prompt never leaves others half-submitted.
        encoded = [self._encode(p) for p in prompt_list]
        for (ids, _, _), params in zip(encoded, params_list, strict=True):
            self._validate(ids, params)
        request_ids: list[str] = []
        try:
            for i, ((ids, text, salt), params) in enumerate(zip(encoded, params_list, strict=True)):
                request_ids.append(
                    self.add_request(
                        ids,
                        params,
                        prompt=text,
                        cache_salt=salt,
                        priority=priority[i] if priority else 0,
                        lora_request=loras[i],
                    )
                )
        except BaseException:
            # NOTE: the core may still refuse a prompt that passed validation (it needs more KV
            # blocks than the cache holds); nothing of this call may stay queued then.
            for request_id in request_ids:
                self.abort_request(request_id)
            raise
        return self._run_until_done(request_ids)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]] | Sequence[Sequence[Mapping[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Generate replies for one conversation or a list of conversations."""
        tokenizer = self._require_tokenizer("chat messages")
        conversations = cast(
            "list[Sequence[Mapping[str, Any]]]",
            [messages] if messages and isinstance(messages[0], Mapping) else list(messages),
        )
        prompts: list[PromptType] = [
            {
                "prompt_token_ids": apply_chat_template(
                    tokenizer, conv, add_generation_prompt=add_generation_prompt
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
        lora_request: LoRARequest | None = None,
    ) -> str:
        """Queue one request without running it (use `step`); returns its id.

        All or nothing: when the core refuses one of an n > 1 request's sequences, the others
        are withdrawn and the request is forgotten before the error propagates.

        Raises:
            ValueError: an invalid prompt or params, or a prompt the KV cache can never hold.
        """
        self._validate(prompt_token_ids, params)
        if lora_request is not None:
            if self.config.lora is None:
                raise ValueError("lora_request needs an LLM built with enable_lora=True")
            # NOTE: the folder is checked now, so a bad one is this call's error, not a step's.
            self.config.lora.check_adapter(lora_request.lora_name, lora_request.lora_path)
        request_id = request_id if request_id is not None else str(next(self._counter))
        children = self._processor.add_request(request_id, prompt, prompt_token_ids, params)
        try:
            for child_id, child in children.items():
                self.engine_core.add_request(
                    child_id,
                    prompt_token_ids,
                    child,
                    eos_token_ids=self.eos_token_ids,
                    priority=priority,
                    cache_salt=cache_salt,
                    lora_request=lora_request,
                )
        except BaseException:
            self.abort_request(request_id)
            raise
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

    def _validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        validate_prompt(prompt_token_ids, params, self.config)
        if self.tokenizer is None:
            validate_without_tokenizer(params)

    def _require_tokenizer(self, what: str) -> Any:
        if self.tokenizer is None:
            raise ValueError(
                f"{what} need a tokenizer, and this LLM runs with skip_tokenizer_init: "
                "give prompts as {'prompt_token_ids': [...]}"
            )
        return self.tokenizer

    def _encode(self, prompt: PromptType) -> tuple[list[int], str | None, str | None]:
        if isinstance(prompt, str):
            return encode_prompt(self._require_tokenizer("text prompts"), prompt), prompt, None
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise ValueError("prompt_token_ids must be a list of integers")
            return list(ids), prompt.get("prompt"), prompt.get("cache_salt")
        if "prompt" in prompt:
            text = str(prompt["prompt"])
            tokenizer = self._require_tokenizer("text prompts")
            return encode_prompt(tokenizer, text), text, prompt.get("cache_salt")
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


def _signature_from_engine_args() -> inspect.Signature:
    """`LLM(model=None, *, <every EngineArgs field>)`, for help() and IDEs (the constructor
    itself takes **kwargs and checks them against the same fields)."""
    hints = typing.get_type_hints(EngineArgs)
    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    for f in dataclasses.fields(EngineArgs):
        kind = (
            inspect.Parameter.POSITIONAL_OR_KEYWORD
            if f.name == "model"
            else inspect.Parameter.KEYWORD_ONLY
        )
        params.append(inspect.Parameter(f.name, kind, default=f.default, annotation=hints[f.name]))
    return inspect.Signature(params, return_annotation=None)


LLM.__init__.__signature__ = _signature_from_engine_args()  # type: ignore[attr-defined]


def _broadcast_params(
    params: SamplingParams | Sequence[SamplingParams] | None,
    count: int,
    default: Callable[[], SamplingParams],
) -> list[SamplingParams]:
    if params is None:
        return [default() for _ in range(count)]
    if isinstance(params, SamplingParams):
        return [params] * count
    params = list(params)
    if len(params) != count:
        raise ValueError(f"sampling_params has {len(params)} entries for {count} prompts")
    return params


def _broadcast_lora(
    lora_request: LoRARequest | Sequence[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    loras = list(lora_request)
    if len(loras) != num_prompts:
        raise ValueError(f"lora_request must have one entry per prompt ({num_prompts})")
    return loras
