"""The pipeline both generation endpoints share: prepare → submit → aggregate or stream.

An endpoint (`serving_completion.py`, `serving_chat.py`) parses its body (`check_body` refuses
what this server would ignore), builds the prompt token ids and the `SamplingParams`
(`sampling.py`), then hands them to `OpenAIServing`: `prepare` checks every prompt against the
context and names the request (a `PreparedRequest`, `serving_types.py`); `respond` admits all of
its sequences at once (prompts × n, all or nothing), submits each prompt to the `EngineClient`,
merges the prompts' output streams and either aggregates them into one JSON body or streams
them as SSE (`serving_responses.py`), shaping choices through the endpoint's `ResponseFormat`.

Errors: `request_error` maps the engine client's exceptions to HTTP statuses; before the
headers the client gets an OpenAI-shaped JSON error, after them an error event and then
`data: [DONE]` (`serving_responses.py`).

Ids: each engine request gets a fresh id; a client's `X-Request-Id` only names the response
(echoed in the header and in the body's `id`) and the log lines, so two requests with the same
header never touch each other.

A completions request may carry a batch of prompts: each becomes its own engine request, and
prompt p's choice j is choice `p * n + j` of the one response (OpenAI's numbering).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from aiohttp import web

from fleetserve.engine.engine_client import (
    EngineClient,
    EngineDeadError,
    EngineOverloadedError,
)
from fleetserve.engine.kv_transfer.params import parse_kv_transfer_params
from fleetserve.engine.request_output import RequestOutput
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.engine.validation import validate_prompt
from fleetserve.openai.errors import RequestError, value_error
from fleetserve.openai.protocol import (
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    SamplingRequest,
    random_id,
)
from fleetserve.server.serving_lora import LoRAModels
from fleetserve.server.serving_responses import (
    aggregate_response,
    merge_prompt_streams,
    request_error,
    stream_response,
)
from fleetserve.server.serving_types import (
    REQUEST_ID_HEADER,
    ChoiceState,
    PreparedRequest,
    PromptInput,
    ResponseFormat,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "REQUEST_ID_HEADER",
    "ChoiceState",
    "OpenAIServing",
    "PreparedRequest",
    "PromptInput",
    "ResponseFormat",
    "request_error",
]

logger = logging.getLogger(__name__)


class OpenAIServing:
    """The generation pipeline of one served model, over an `EngineClient`."""

    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
        *,
        models: LoRAModels | None = None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.models = models or LoRAModels(
            model_name, engine.config.model.model, engine.config.model.max_model_len, None
        )
        """The names `model` may take (the base model and its LoRA adapters)."""
        self.max_prompts_per_request = max_prompts_per_request
        self.tokenizer: PreTrainedTokenizerBase | None = engine.tokenizer
        self.max_model_len = engine.config.model.max_model_len
        self.scheduling_policy = engine.config.scheduler.policy
        self.generation_defaults = engine.config.generation

    def check_body(self, body: SamplingRequest) -> None:
        """Refuse what this server would otherwise ignore (each a 400 naming the field)."""
        self.check_model(body.model)
        unsupported = body.unsupported_feature()
        if unsupported is not None:
            name, feature = unsupported
            raise RequestError(
                400,
                f"{name} is not supported: this server has no {feature} yet; leave {name} unset",
                param=name,
            )
        if body.priority != 0 and self.scheduling_policy != "priority":
            raise RequestError(
                400,
                f"priority is honoured only when the engine runs --scheduling-policy priority; "
                f"this one schedules {self.scheduling_policy}, so priority must be 0",
                param="priority",
            )

    def require_tokenizer(self, what: str, param: str) -> PreTrainedTokenizerBase:
        """The tokenizer, or a 400 saying that `what` needs one (skip_tokenizer_init)."""
        if self.tokenizer is None:
            raise RequestError(
                400,
                f"this server runs with skip_tokenizer_init (no tokenizer), so it cannot take "
                f"{what}: send prompts as token id lists (outputs come as token_ids)",
                param=param,
            )
        return self.tokenizer

    def check_model(self, model: str | None) -> None:
        """Raises a 400 `model_not_found` unless `model` is served (see `LoRAModels.resolve`)."""
        self.models.resolve(model)

    def response_model(self, model: str | None) -> str:
        """The `model` a response names: the adapter asked for, else the base model."""
        return self.model_name if model is None else model

    def prepare(
        self,
        request: web.Request,
        body: SamplingRequest,
        prompts: list[tuple[list[int], str | None]],
        params: SamplingParams,
        id_prefix: str,
    ) -> PreparedRequest:
        """Check every prompt's length against the context and name the engine requests.

        Raises:
            RequestError: 400 when a prompt is invalid for the model (`validate_prompt`) or a
                prompt plus `max_tokens` exceeds `max_model_len`.
        """
        self._check_kv_transfer_params(body, len(prompts), params)
        for ids, _ in prompts:
            # NOTE: what can be checked here is, before admission, so bad input is a 400 and
            # never a 429 (the engine client checks again, with the KV cache's capacity).
            try:
                validate_prompt(ids, params, self.engine.config)
            except ValueError as exc:
                raise value_error(exc, "prompt") from exc
            if params.max_tokens is None or len(ids) + params.max_tokens <= self.max_model_len:
                continue
            raise RequestError(
                400,
                f"This model's maximum context length is {self.max_model_len} tokens. However, "
                f"you requested {len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, "
                f"{params.max_tokens} in the completion). Please reduce the length of the "
                "prompt or max_tokens.",
                param="max_tokens" if len(ids) < self.max_model_len else "prompt",
            )
        # NOTE: a client (or a router hop) may name the request with X-Request-Id; it names the
        # response and the logs, never an engine request: clients reuse ids (retries).
        client_id = request.headers.get(REQUEST_ID_HEADER)
        engine_id = random_id(id_prefix)
        if client_id:
            logger.debug("%s is X-Request-Id %r", engine_id, client_id)
        if len(prompts) == 1:
            engine_ids = [engine_id]
        else:
            engine_ids = [f"{engine_id}-{i}" for i in range(len(prompts))]
        return PreparedRequest(
            f"{id_prefix}-{client_id}" if client_id else engine_id,
            body,
            [
                PromptInput(engine_id, ids, text)
                for engine_id, (ids, text) in zip(engine_ids, prompts, strict=True)
            ],
            params,
            client_id,
            return_token_ids=body.return_token_ids or self.tokenizer is None,
        )

    def _check_kv_transfer_params(
        self, body: SamplingRequest, num_prompts: int, params: SamplingParams
    ) -> None:
        """A P/D leg is one prompt, one sequence, with well-formed params (400 otherwise;
        whether this engine plays the role, and its hash, the core checks)."""
        if body.kv_transfer_params is None:
            return
        try:
            role = parse_kv_transfer_params(body.kv_transfer_params)
        except ValueError as exc:
            raise RequestError(400, str(exc), param="kv_transfer_params") from exc
        if role is not None and (num_prompts != 1 or params.n != 1):
            raise RequestError(
                400,
                "kv_transfer_params need one prompt and n=1 (a transfer moves one prompt's KV)",
                param="kv_transfer_params",
            )

    async def respond(
        self, request: web.Request, prepared: PreparedRequest, response_format: ResponseFormat
    ) -> web.StreamResponse:
        """Admit and submit the prompts, then answer with one JSON body or an SSE stream."""
        self._admit(prepared)
        submitted: list[str] = []
        try:
            outputs = merge_prompt_streams(self._submit(prepared, submitted))
            if prepared.body.stream:
                return await stream_response(request, prepared, response_format, outputs)
            return await aggregate_response(prepared, response_format, outputs)
        finally:
            # NOTE: a no-op once finished; aborts (frees KV blocks) on disconnect, on error, and
            # for the prompts of a batch added before a later one was refused. Only ids this
            # request added: an id it did not add is someone else's.
            for request_id in submitted:
                self.engine.abort(request_id)

    def _admit(self, prepared: PreparedRequest) -> None:
        """All the request's sequences (prompts × n) are admitted at once, or none."""
        try:
            self.engine.check_admission(prepared.num_choices)
        except (EngineDeadError, EngineOverloadedError) as exc:
            raise request_error(exc) from exc
        except ValueError as exc:
            # More sequences than may ever wait: retrying cannot help, so it is bad input.
            raise RequestError(
                400, str(exc), param="n" if prepared.params.n > 1 else "prompt"
            ) from exc

    def _submit(
        self, prepared: PreparedRequest, submitted: list[str]
    ) -> list[AsyncIterator[RequestOutput]]:
        """Add every prompt to the engine (admitted already); `submitted` collects the ids."""
        streams = []
        for prompt in prepared.prompts:
            try:
                stream = self.engine.generate(
                    prompt.request_id,
                    prompt.token_ids,
                    prepared.params,
                    prompt=prompt.text,
                    priority=prepared.body.priority,
                    cache_salt=prepared.body.cache_salt,
                    kv_transfer_params=prepared.body.kv_transfer_params,
                    admit=False,
                    lora_request=self.models.resolve(prepared.body.model),
                )
            except (ValueError, EngineDeadError, EngineOverloadedError) as exc:
                raise request_error(exc, default_param="prompt") from exc
            submitted.append(prompt.request_id)
            streams.append(stream)
        return streams
