"""The pipeline both generation endpoints share: prepare → submit → aggregate or stream.

An endpoint (`serving_completion.py`, `serving_chat.py`) parses its body, builds the prompt
token ids and the `SamplingParams` (`sampling.py`), then hands them to `OpenAIServing`:
`prepare` checks every prompt against the context and names the request; `respond` submits
each prompt to the `EngineClient` (admission is decided once, by the first), merges the
prompts' output streams and either aggregates them into one JSON body or streams them as SSE,
shaping choices through the endpoint's `ResponseFormat`. A stream is `data: {chunk}` events,
an optional usage-only chunk (`stream_options.include_usage`), and `data: [DONE]`.

A completions request may carry a batch of prompts: each becomes its own engine request, and
prompt p's choice j is choice `p * n + j` of the one response (OpenAI's numbering); their
outputs are merged as they arrive, so a stream interleaves the choices.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from aiohttp import web

from fleetserve.engine.engine_client import EngineClient, EngineDeadError, EngineOverloadedError
from fleetserve.engine.request_output import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestOutput,
)
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.openai.errors import RequestError, error_body, value_error
from fleetserve.openai.protocol import PromptTokensDetails, SamplingRequest, UsageInfo, random_id

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "REQUEST_ID_HEADER",
    "ChoiceState",
    "OpenAIServing",
    "PreparedRequest",
    "PromptInput",
    "ResponseFormat",
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
    """The response's id (also the engine request's, unless the prompts are a batch)."""
    body: SamplingRequest
    prompts: list[PromptInput]
    params: SamplingParams
    client_request_id: str | None = None
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)
    """Prompt index → its prompt logprobs, filled as outputs arrive (echo with logprobs)."""

    @property
    def headers(self) -> dict[str, str]:
        return {REQUEST_ID_HEADER: self.client_request_id} if self.client_request_id else {}

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

    def __init__(self, engine: EngineClient, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer: PreTrainedTokenizerBase = engine.tokenizer
        self.max_model_len = engine.config.model.max_model_len

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
            RequestError: 400 when a prompt plus `max_tokens` exceeds `max_model_len`.
        """
        for ids, _ in prompts:
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
        # NOTE: a client (or a router hop) may name the request with X-Request-Id; it is echoed
        # back and used in the engine, so one id follows the request through P/D and logs.
        client_id = request.headers.get(REQUEST_ID_HEADER)
        request_id = f"{id_prefix}-{client_id}" if client_id else random_id(id_prefix)
        if len(prompts) == 1:
            engine_ids = [request_id]
        else:
            engine_ids = [f"{request_id}-{i}" for i in range(len(prompts))]
        return PreparedRequest(
            request_id,
            body,
            [
                PromptInput(engine_id, ids, text)
                for engine_id, (ids, text) in zip(engine_ids, prompts, strict=True)
            ],
            params,
            client_id,
        )

    async def respond(
        self, request: web.Request, prepared: PreparedRequest, response_format: ResponseFormat
    ) -> web.StreamResponse:
        """Submit the prompts and answer with one JSON body or an SSE stream."""
        try:
            outputs = _merge_prompt_streams(self._submit(prepared))
            if prepared.body.stream:
                return await self._stream(request, prepared, response_format, outputs)
            return await self._aggregate(prepared, response_format, outputs)
        finally:
            # NOTE: a no-op once finished; aborts (frees KV blocks) on disconnect, on error, and
            # for the prompts of a batch admitted before a later one was refused.
            for prompt in prepared.prompts:
                self.engine.abort(prompt.request_id)

    def _submit(self, prepared: PreparedRequest) -> list[AsyncIterator[RequestOutput]]:
        """Add every prompt to the engine; the first one decides admission for the batch."""
        streams = []
        for prompt_index, prompt in enumerate(prepared.prompts):
            try:
                streams.append(
                    self.engine.generate(
                        prompt.request_id,
                        prompt.token_ids,
                        prepared.params,
                        prompt=prompt.text,
                        priority=prepared.body.priority,
                        cache_salt=prepared.body.cache_salt,
                        admit=prompt_index == 0,
                    )
                )
            except ValueError as exc:
                raise value_error(exc, "prompt") from exc
            except EngineOverloadedError as exc:
                raise RequestError(429, str(exc), retry_after_s=exc.retry_after_s) from exc
            except EngineDeadError as exc:
                raise _engine_dead(exc) from exc
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
                for delta in output.outputs:
                    choice = choices[prepared.choice_index(prompt_index, delta.index)]
                    choice.text += delta.text
                    choice.token_ids.extend(delta.token_ids)
                    choice.logprobs.extend(delta.logprobs or [])
                    choice.finish_reason = delta.finish_reason
                    choice.stop_reason = delta.stop_reason
        except EngineDeadError as exc:
            raise _engine_dead(exc) from exc
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
        except EngineDeadError as exc:
            await response.write(_sse(error_body(503, str(exc))))
        except ConnectionError:
            logger.info("client disconnected; aborting %s", prepared.request_id)
            return response
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _engine_dead(exc: EngineDeadError) -> RequestError:
    return RequestError(503, str(exc), retry_after_s=ENGINE_DEAD_RETRY_AFTER_S)


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
