"""The pipeline both generation endpoints share: prepare → submit → aggregate or stream.

An endpoint (`serving_completion.py`, `serving_chat.py`) parses its body (`check_body` refuses
what this server would ignore), builds the prompt token ids and the `SamplingParams`
(`sampling.py`), then hands them to `OpenAIServing`: `prepare` checks every prompt against the
context and names the request; `respond` admits all of its sequences at once (prompts × n, all
or nothing), submits each prompt to the `EngineClient`, merges the prompts' output streams and
either aggregates them into one JSON body or streams them as SSE, shaping choices through the
endpoint's `ResponseFormat`. A stream is `data: {chunk}` events, an optional usage-only chunk
(`stream_options.include_usage`), and `data: [DONE]`.

Errors: before the headers, an OpenAI-shaped JSON error (`request_error` maps the engine's
exceptions to statuses); after them, an error event and then `data: [DONE]` all the same. Only
a client that went away gets no ending.

Ids: each engine request gets a fresh id; a client's `X-Request-Id` only names the response
(echoed in the header and in the body's `id`) and the log lines, so two requests with the same
header never touch each other.

A completions request may carry a batch of prompts: each becomes its own engine request, and
prompt p's choice j is choice `p * n + j` of the one response (OpenAI's numbering); their
outputs are merged as they arrive, so a stream interleaves the choices.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from fleetserve.engine.engine_client import (
    EngineClient,
    EngineDeadError,
    EngineOverloadedError,
    EngineRequestError,
    RequestRejectedError,
    SlowReaderError,
)
from fleetserve.engine.kv_transfer.params import KV_TRANSFER_FAILED, parse_kv_transfer_params
from fleetserve.engine.request_output import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestOutput,
)
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.engine.validation import validate_prompt
from fleetserve.openai.errors import RequestError, error_body, value_error
from fleetserve.openai.protocol import (
    DEFAULT_MAX_PROMPTS_PER_REQUEST,
    PromptTokensDetails,
    SamplingRequest,
    UsageInfo,
    random_id,
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

REQUEST_ID_HEADER = "X-Request-Id"

ENGINE_DEAD_RETRY_AFTER_S = 5
"""Retry-After of a 503 when the engine is gone (a supervisor restarts the server)."""


@dataclass
class ChoiceState:
    """One choice accumulated over the deltas of a non-streaming request."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class PromptInput:
    """One prompt of a request and the engine request that serves it."""

    request_id: str
    token_ids: list[int]
    text: str | None
    """The prompt as the client sent it, when it was text."""


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request, ready for the engine."""

    request_id: str
    """The response's id (`{prefix}-{X-Request-Id}` when the client named the request)."""
    body: SamplingRequest
    prompts: list[PromptInput]
    params: SamplingParams
    client_request_id: str | None = None
    return_token_ids: bool = False
    """Responses carry token ids (asked for, or the only output without a tokenizer)."""
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)
    """Prompt index → its prompt logprobs, filled as outputs arrive (echo with logprobs)."""
    kv_transfer_params: dict[str, Any] = field(default_factory=dict)
    """The engine's answer to a P/D leg (a producer's), filled when the request finishes."""

    @property
    def headers(self) -> dict[str, str]:
        return {REQUEST_ID_HEADER: self.client_request_id} if self.client_request_id else {}

    @property
    def log_name(self) -> str:
        """How logs name it: the first engine id, and the client's id when it sent one."""
        name = self.prompts[0].request_id
        return (
            f"{name} (X-Request-Id {self.client_request_id!r})" if self.client_request_id else name
        )

    @property
    def num_choices(self) -> int:
        return len(self.prompts) * self.params.n

    def choice_index(self, prompt_index: int, completion_index: int) -> int:
        """The response's numbering: prompt p's sequence j is choice `p * n + j`."""
        return prompt_index * self.params.n + completion_index

    def prompt_of(self, choice_index: int) -> PromptInput:
        return self.prompts[choice_index // self.params.n]


class ResponseFormat(Protocol):
    """How one endpoint shapes its responses (one instance per request: it may keep state
    across the chunks of a stream)."""

    def full(self, prepared: PreparedRequest, choices: list[ChoiceState], usage: UsageInfo) -> str:
        """The JSON body of a non-streaming response."""
        ...

    def first_chunks(self, prepared: PreparedRequest) -> list[str]:
        """Chunks sent before any output (chat: each choice's role)."""
        ...

    def chunk(
        self,
        prepared: PreparedRequest,
        choice_index: int,
        delta: CompletionOutput,
        usage: UsageInfo | None,
    ) -> str | None:
        """The chunk of one choice's delta, or None when it carries nothing."""
        ...

    def usage_chunk(self, prepared: PreparedRequest, usage: UsageInfo) -> str:
        """The final usage-only chunk (`stream_options.include_usage`)."""
        ...


class OpenAIServing:
    """The generation pipeline of one served model, over an `EngineClient`."""

    def __init__(
        self,
        engine: EngineClient,
        model_name: str,
        max_prompts_per_request: int = DEFAULT_MAX_PROMPTS_PER_REQUEST,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.max_prompts_per_request = max_prompts_per_request
        self.tokenizer: PreTrainedTokenizerBase | None = engine.tokenizer
        self.max_model_len = engine.config.model.max_model_len
        self.scheduling_policy = engine.config.scheduler.policy

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
        # NOTE: vLLM answers 404 here; our contract (issue 3) treats an unknown model as bad
        # input like any other field, so 400, with OpenAI's code so clients can tell it apart.
        if model is not None and model != self.model_name:
            raise RequestError(
                400,
                f"model must be one of ['{self.model_name}'], got `{model}`",
                param="model",
                code="model_not_found",
            )

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
            outputs = _merge_prompt_streams(self._submit(prepared, submitted))
            if prepared.body.stream:
                return await self._stream(request, prepared, response_format, outputs)
            return await self._aggregate(prepared, response_format, outputs)
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
                )
            except (ValueError, EngineDeadError, EngineOverloadedError) as exc:
                raise request_error(exc, default_param="prompt") from exc
            submitted.append(prompt.request_id)
            streams.append(stream)
        return streams

    async def _aggregate(
        self,
        prepared: PreparedRequest,
        response_format: ResponseFormat,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
    ) -> web.Response:
        choices = [ChoiceState() for _ in range(prepared.num_choices)]
        cached: dict[int, int] = {}
        try:
            async for prompt_index, output in outputs:
                cached[prompt_index] = output.num_cached_tokens
                if output.prompt_logprobs is not None:
                    prepared.prompt_logprobs[prompt_index] = output.prompt_logprobs
                if output.kv_transfer_params is not None:
                    prepared.kv_transfer_params.update(output.kv_transfer_params)
                for delta in output.outputs:
                    choice = choices[prepared.choice_index(prompt_index, delta.index)]
                    choice.text += delta.text
                    choice.token_ids.extend(delta.token_ids)
                    choice.logprobs.extend(delta.logprobs or [])
                    choice.finish_reason = delta.finish_reason
                    choice.stop_reason = delta.stop_reason
        except Exception as exc:
            raise request_error(exc, log_name=prepared.log_name) from exc
        usage = _usage(prepared, sum(len(c.token_ids) for c in choices), sum(cached.values()))
        return web.Response(
            text=response_format.full(prepared, choices, usage),
            content_type="application/json",
            headers=prepared.headers,
        )

    async def _stream(
        self,
        request: web.Request,
        prepared: PreparedRequest,
        response_format: ResponseFormat,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **prepared.headers,
            }
        )
        await response.prepare(request)
        num_generated = 0
        cached: dict[int, int] = {}
        finished: set[int] = set()
        try:
            for event in response_format.first_chunks(prepared):
                await response.write(_sse(event))
            async for prompt_index, output in outputs:
                cached[prompt_index] = output.num_cached_tokens
                if output.prompt_logprobs is not None:
                    prepared.prompt_logprobs[prompt_index] = output.prompt_logprobs
                if output.kv_transfer_params is not None:
                    prepared.kv_transfer_params.update(output.kv_transfer_params)
                for delta in output.outputs:
                    choice_index = prepared.choice_index(prompt_index, delta.index)
                    # NOTE: with n > 1 a finished choice keeps appearing (empty) while its
                    # siblings run; its finish_reason is sent once.
                    if choice_index in finished:
                        continue
                    if delta.finish_reason is not None:
                        finished.add(choice_index)
                    num_generated += len(delta.token_ids)
                    running_usage = (
                        _usage(prepared, num_generated, sum(cached.values()))
                        if prepared.body.continuous_usage_in_stream
                        else None
                    )
                    chunk = response_format.chunk(prepared, choice_index, delta, running_usage)
                    if chunk is not None:
                        await response.write(_sse(chunk))
            if prepared.body.include_usage_in_stream:
                usage = _usage(prepared, num_generated, sum(cached.values()))
                await response.write(_sse(response_format.usage_chunk(prepared, usage)))
        except ConnectionError:
            logger.info("client disconnected; aborting %s", prepared.log_name)
            return response
        except Exception as exc:
            # NOTE: the headers are out; the error goes in the stream, which still ends.
            error = request_error(exc, log_name=prepared.log_name)
            try:
                await response.write(
                    _sse(error_body(error.status, error.message, error.param, error.code))
                )
            except ConnectionError:
                return response
        try:
            await response.write(b"data: [DONE]\n\n")
            await response.write_eof()
        except ConnectionError:
            logger.info("client disconnected at the end of %s", prepared.log_name)
        return response


def request_error(
    exc: BaseException, *, default_param: str | None = None, log_name: str = "a request"
) -> RequestError:
    """The HTTP error for an exception from the engine client (see `EngineClient.generate`):
    503 dead, 429 overloaded, 400 invalid or refused by the core, 500 failed by the engine,
    408 a reader too slow; anything else is logged and answered as a 500."""
    if isinstance(exc, RequestError):
        return exc
    if isinstance(exc, EngineDeadError):
        return RequestError(503, str(exc), retry_after_s=ENGINE_DEAD_RETRY_AFTER_S)
    if isinstance(exc, EngineOverloadedError):
        return RequestError(429, str(exc), retry_after_s=exc.retry_after_s)
    if isinstance(exc, RequestRejectedError):
        return RequestError(400, f"the engine refused the request: {exc}")
    if isinstance(exc, ValueError):
        return value_error(exc, default_param)
    if isinstance(exc, EngineRequestError) and f"{KV_TRANSFER_FAILED}:" in str(exc):
        # NOTE: the prompt's KV never arrived from its prefill engine: a router may retry the
        # request elsewhere (another pair, or colocated), so it is a 503 with its own code.
        logger.warning("%s: %s", log_name, exc)
        return RequestError(503, str(exc), code=KV_TRANSFER_FAILED, retry_after_s=0)
    if isinstance(exc, EngineRequestError):
        logger.error("%s failed in the engine: %s", log_name, exc)
        return RequestError(500, str(exc))
    if isinstance(exc, SlowReaderError):
        return RequestError(408, str(exc), code="slow_reader")
    logger.error("unexpected error serving %s", log_name, exc_info=exc)
    return RequestError(500, "internal server error")


def _sse(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode()


async def _merge_prompt_streams(
    streams: list[AsyncIterator[RequestOutput]],
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (prompt index, output) from every prompt's stream as the outputs arrive; a failure
    of any prompt's stream fails the merged one."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(prompt_index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                await queue.put((prompt_index, output))
        except Exception as exc:
            # The consumer re-raises it: one failed prompt fails the response.
            await queue.put((prompt_index, exc))
        await queue.put((prompt_index, None))

    tasks = [asyncio.create_task(pump(i, stream)) for i, stream in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            prompt_index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield prompt_index, item
    finally:
        for task in tasks:
            task.cancel()


def _usage(prepared: PreparedRequest, num_generated: int, num_cached: int) -> UsageInfo:
    num_prompt = sum(len(p.token_ids) for p in prepared.prompts)
    return UsageInfo(
        prompt_tokens=num_prompt,
        completion_tokens=num_generated,
        total_tokens=num_prompt + num_generated,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached),
    )
