"""Answering a submitted request: one JSON body (`aggregate_response`) or an SSE stream
(`stream_response`), over the merged outputs of its prompts (`merge_prompt_streams`); and the
HTTP error for an engine client's exception (`request_error`).

A stream is `data: {chunk}` events, an optional usage-only chunk
(`stream_options.include_usage`), and `data: [DONE]`. Errors: before the headers, an
OpenAI-shaped JSON error; after them, an error event and then `data: [DONE]` all the same. Only
a client that went away gets no ending.

A completions request may carry a batch of prompts: their outputs are merged as they arrive,
so a stream interleaves the choices (prompt p's choice j is choice `p * n + j`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from aiohttp import web

from fleetserve.common.error_codes import INVALID_GRAMMAR, KV_TRANSFER_FAILED
from fleetserve.engine.engine_client import (
    EngineDeadError,
    EngineOverloadedError,
    EngineRequestError,
    RequestRejectedError,
    SlowReaderError,
)
from fleetserve.engine.request_output import RequestOutput
from fleetserve.openai.errors import RequestError, error_body, value_error
from fleetserve.openai.protocol import PromptTokensDetails, UsageInfo
from fleetserve.server.serving_types import ChoiceState, PreparedRequest, ResponseFormat

__all__ = [
    "ENGINE_DEAD_RETRY_AFTER_S",
    "aggregate_response",
    "merge_prompt_streams",
    "request_error",
    "stream_response",
]

# NOTE: the pipeline's logger (serving.py's), so that the log lines keep their logger name.
logger = logging.getLogger("fleetserve.server.serving")

ENGINE_DEAD_RETRY_AFTER_S = 5
"""Retry-After of a 503 when the engine is gone (a supervisor restarts the server)."""


async def aggregate_response(
    prepared: PreparedRequest,
    response_format: ResponseFormat,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
) -> web.Response:
    """Accumulate every choice's deltas, then answer with the endpoint's one JSON body."""
    choices = [ChoiceState() for _ in range(prepared.num_choices)]
    cached: dict[int, int] = {}
    try:
        async for prompt_index, output in outputs:
            _note_output(prepared, cached, prompt_index, output)
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


async def stream_response(
    request: web.Request,
    prepared: PreparedRequest,
    response_format: ResponseFormat,
    outputs: AsyncIterator[tuple[int, RequestOutput]],
) -> web.StreamResponse:
    """Send the headers, then each delta as the endpoint's SSE chunk, and end the stream."""
    response = web.StreamResponse(
        headers={
            "Content-Type": "text/event-stream",
            "Cache-Control": "no-cache",
            **prepared.headers,
        }
    )
    try:
        await response.prepare(request)
    except ConnectionError:
        # NOTE: the client left before the headers went out (e.g. a router that timed out on
        # an engine stalled meanwhile): not an error of ours; the caller aborts the request.
        logger.info("client disconnected before the stream began; aborting %s", prepared.log_name)
        return response
    num_generated = 0
    cached: dict[int, int] = {}
    finished: set[int] = set()
    try:
        for event in response_format.first_chunks(prepared):
            await response.write(_sse(event))
        async for prompt_index, output in outputs:
            _note_output(prepared, cached, prompt_index, output)
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
    503 dead, 429 overloaded, 400 invalid or refused by the core (a constraint that does not
    compile included), 500 failed by the engine,
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
    if isinstance(exc, EngineRequestError) and f"{INVALID_GRAMMAR}:" in str(exc):
        # NOTE: the request's schema, regex or grammar did not compile in the engine: its fault.
        return RequestError(400, str(exc), code=INVALID_GRAMMAR)
    if isinstance(exc, EngineRequestError):
        logger.error("%s failed in the engine: %s", log_name, exc)
        return RequestError(500, str(exc))
    if isinstance(exc, SlowReaderError):
        return RequestError(408, str(exc), code="slow_reader")
    logger.error("unexpected error serving %s", log_name, exc_info=exc)
    return RequestError(500, "internal server error")


def _note_output(
    prepared: PreparedRequest, cached: dict[int, int], prompt_index: int, output: RequestOutput
) -> None:
    """Keep what an output says about its whole prompt: the cached token count (into
    `cached`), its prompt logprobs and a P/D leg's kv_transfer_params (into `prepared`)."""
    cached[prompt_index] = output.num_cached_tokens
    if output.prompt_logprobs is not None:
        prepared.prompt_logprobs[prompt_index] = output.prompt_logprobs
    if output.kv_transfer_params is not None:
        prepared.kv_transfer_params.update(output.kv_transfer_params)


def _sse(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode()


async def merge_prompt_streams(
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
