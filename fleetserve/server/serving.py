"""POST /v1/completions and /v1/chat/completions: request → engine → JSON or SSE.

Both endpoints share one pipeline (`_prepare` → `AsyncLLM.generate` → aggregate or stream) and
differ only in how a prompt is built (raw text / token ids vs. chat template) and how choices and
logprobs are shaped (`_CompletionFormat`, `_ChatFormat`). A stream is `data: {chunk}` events,
an optional usage-only chunk (`stream_options.include_usage`), and `data: [DONE]`.

A completions request may carry a batch of prompts: each becomes its own engine request, and
prompt p's choice j is choice `p * n + j` of the one response (OpenAI's numbering); their
outputs are merged as they arrive, so a stream interleaves the choices.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web

from fleetserve.engine.chat import apply_chat_template
from fleetserve.engine.outputs import CompletionOutput, Logprob, PromptLogprobs, RequestOutput
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.engine.tokenizer import encode_prompt
from fleetserve.server.async_llm import AsyncLLM, EngineDeadError, EngineOverloadedError
from fleetserve.server.errors import RequestError, error_body, parse_body, value_error
from fleetserve.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobContent,
    ChatLogprobs,
    ChatMessage,
    ChatTopLogprob,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    DeltaMessage,
    PromptTokensDetails,
    SamplingRequest,
    UsageInfo,
    random_id,
)

logger = logging.getLogger(__name__)

REQUEST_ID_HEADER = "X-Request-Id"


@dataclass
class _Choice:
    """One choice accumulated over the deltas of a non-streaming request."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class _Prompt:
    """One prompt of a request and the engine request that serves it."""

    request_id: str
    token_ids: list[int]
    text: str | None
    """The prompt as the client sent it, when it was text."""


@dataclass(frozen=True)
class _Prepared:
    request_id: str
    """The response's id (also the engine request's, unless the prompts are a batch)."""
    body: SamplingRequest
    prompts: list[_Prompt]
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

    def prompt_of(self, choice_index: int) -> _Prompt:
        return self.prompts[choice_index // self.params.n]


class _Format(Protocol):
    """How one endpoint shapes its responses."""

    def full(
        self, prep: _Prepared, model: str, choices: list[_Choice], usage: UsageInfo
    ) -> str: ...

    def first_chunks(self, prep: _Prepared, model: str) -> list[str]: ...

    def chunk(
        self, prep: _Prepared, model: str, delta: CompletionOutput, usage: UsageInfo | None
    ) -> str | None: ...

    def usage_chunk(self, prep: _Prepared, model: str, usage: UsageInfo) -> str: ...


class OpenAIServing:
    """The two generation endpoints of one served model."""

    def __init__(self, engine: AsyncLLM, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokenizer = engine.tokenizer
        self.max_model_len = engine.config.model.max_model_len

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await parse_body(request, CompletionRequest)
        self.check_model(body.model)
        try:
            prompts = body.prompt_list()
        except ValueError as exc:
            raise value_error(exc, "prompt") from exc
        encoded: list[tuple[list[int], str | None]] = [
            (encode_prompt(self.tokenizer, p), p) if isinstance(p, str) else (list(p), None)
            for p in prompts
        ]
        prep = self._prepare(request, body, encoded, lambda: body.to_sampling_params(), "cmpl")
        return await self._respond(request, prep, _CompletionFormat(self.tokenizer))

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await parse_body(request, ChatCompletionRequest)
        self.check_model(body.model)
        try:
            ids = apply_chat_template(
                self.tokenizer, body.messages, add_generation_prompt=body.add_generation_prompt
            )
        except ValueError as exc:
            raise RequestError(400, str(exc), param="messages") from exc
        room = max(1, self.max_model_len - len(ids))
        prep = self._prepare(
            request, body, [(ids, None)], lambda: body.to_sampling_params(room), "chatcmpl"
        )
        return await self._respond(request, prep, _ChatFormat(self.tokenizer))

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

    def _prepare(
        self,
        request: web.Request,
        body: SamplingRequest,
        prompts: list[tuple[list[int], str | None]],
        make_params: Callable[[], SamplingParams],
        id_prefix: str,
    ) -> _Prepared:
        """Validate the params and every prompt's length before anything reaches the engine."""
        try:
            params = make_params()
        except ValueError as exc:
            raise value_error(exc) from exc
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
        return _Prepared(
            request_id,
            body,
            [_Prompt(rid, ids, text) for rid, (ids, text) in zip(engine_ids, prompts, strict=True)],
            params,
            client_id,
        )

    async def _respond(
        self, request: web.Request, prep: _Prepared, fmt: _Format
    ) -> web.StreamResponse:
        try:
            streams = []
            for i, prompt in enumerate(prep.prompts):
                try:
                    streams.append(
                        self.engine.generate(
                            prompt.request_id,
                            prompt.token_ids,
                            prep.params,
                            prompt=prompt.text,
                            priority=prep.body.priority,
                            cache_salt=prep.body.cache_salt,
                            admit=i == 0,
                        )
                    )
                except ValueError as exc:
                    raise value_error(exc, "prompt") from exc
                except EngineOverloadedError as exc:
                    raise RequestError(429, str(exc), retry_after_s=exc.retry_after_s) from exc
                except EngineDeadError as exc:
                    raise RequestError(503, str(exc), retry_after_s=5) from exc
            outputs = _merge(streams, prep.params.n)
            if prep.body.stream:
                return await self._stream(request, prep, fmt, outputs)
            return await self._full(prep, fmt, outputs)
        finally:
            # NOTE: a no-op once finished; aborts (frees KV blocks) on disconnect, on error, and
            # for the prompts of a batch admitted before a later one was refused.
            for prompt in prep.prompts:
                self.engine.abort(prompt.request_id)

    async def _full(
        self, prep: _Prepared, fmt: _Format, outputs: AsyncIterator[tuple[int, RequestOutput]]
    ) -> web.Response:
        choices = [_Choice() for _ in range(prep.num_choices)]
        cached: dict[int, int] = {}
        try:
            async for prompt_index, output in outputs:
                cached[prompt_index] = output.num_cached_tokens
                if output.prompt_logprobs is not None:
                    prep.prompt_logprobs[prompt_index] = output.prompt_logprobs
                for delta in output.outputs:
                    choice = choices[delta.index]
                    choice.text += delta.text
                    choice.token_ids.extend(delta.token_ids)
                    choice.logprobs.extend(delta.logprobs or [])
                    choice.finish_reason = delta.finish_reason
                    choice.stop_reason = delta.stop_reason
        except EngineDeadError as exc:
            raise RequestError(503, str(exc), retry_after_s=5) from exc
        usage = _usage(prep, sum(len(c.token_ids) for c in choices), sum(cached.values()))
        return web.Response(text=fmt.full(prep, self.model_name, choices, usage),
                            content_type="application/json", headers=prep.headers)  # fmt: skip

    async def _stream(
        self,
        request: web.Request,
        prep: _Prepared,
        fmt: _Format,
        outputs: AsyncIterator[tuple[int, RequestOutput]],
    ) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={
                "Content-Type": "text/event-stream",
                "Cache-Control": "no-cache",
                **prep.headers,
            }
        )
        await response.prepare(request)
        num_generated = 0
        cached: dict[int, int] = {}
        finished: set[int] = set()
        try:
            for event in fmt.first_chunks(prep, self.model_name):
                await response.write(_sse(event))
            async for prompt_index, output in outputs:
                cached[prompt_index] = output.num_cached_tokens
                if output.prompt_logprobs is not None:
                    prep.prompt_logprobs[prompt_index] = output.prompt_logprobs
                for delta in output.outputs:
                    # NOTE: with n > 1 a finished choice keeps appearing (empty) while its
                    # siblings run; its finish_reason is sent once.
                    if delta.index in finished:
                        continue
                    if delta.finish_reason is not None:
                        finished.add(delta.index)
                    num_generated += len(delta.token_ids)
                    running = (
                        _usage(prep, num_generated, sum(cached.values()))
                        if prep.body.continuous_usage_in_stream
                        else None
                    )
                    chunk = fmt.chunk(prep, self.model_name, delta, running)
                    if chunk is not None:
                        await response.write(_sse(chunk))
            if prep.body.include_usage_in_stream:
                usage = _usage(prep, num_generated, sum(cached.values()))
                await response.write(_sse(fmt.usage_chunk(prep, self.model_name, usage)))
        except EngineDeadError as exc:
            await response.write(_sse(error_body(503, str(exc))))
        except ConnectionError:
            logger.info("client disconnected; aborting %s", prep.request_id)
            return response
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _sse(payload: str) -> bytes:
    return f"data: {payload}\n\n".encode()


async def _merge(
    streams: list[AsyncIterator[RequestOutput]], n: int
) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Yield (prompt index, output) from every stream as outputs arrive, with each output's
    choice indices renumbered to the response's (`prompt index * n + index`)."""
    if len(streams) == 1:
        async for output in streams[0]:
            yield 0, output
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for output in stream:
                await queue.put((index, output))
        except Exception as exc:
            # The consumer re-raises it: one failed prompt fails the response.
            await queue.put((index, exc))
        await queue.put((index, None))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        remaining = len(tasks)
        while remaining:
            index, item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                for delta in item.outputs:
                    delta.index += index * n
                yield index, item
    finally:
        for task in tasks:
            task.cancel()


def _usage(prep: _Prepared, num_generated: int, num_cached: int) -> UsageInfo:
    num_prompt = sum(len(p.token_ids) for p in prep.prompts)
    return UsageInfo(
        prompt_tokens=num_prompt,
        completion_tokens=num_generated,
        total_tokens=num_prompt + num_generated,
        prompt_tokens_details=PromptTokensDetails(cached_tokens=num_cached),
    )


def _top(entry: dict[int, Logprob], token_id: int, k: int) -> list[tuple[int, Logprob]]:
    """The top-k alternatives of one position (by rank), excluding nothing but beyond-k."""
    ranked = sorted(entry.items(), key=lambda item: item[1].rank or 0)
    return [(tid, lp) for tid, lp in ranked if lp.rank is not None and lp.rank <= k][:k]


class _CompletionFormat:
    """Per request: it keeps each choice's text offset across stream chunks."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._text_offsets: dict[int, int] = {}
        self._started: set[int] = set()

    def _logprobs(
        self,
        prep: _Prepared,
        token_ids: list[int],
        entries: list[dict[int, Logprob]],
        index: int,
        *,
        with_prompt: bool,
    ) -> CompletionLogprobs | None:
        """The logprobs of `token_ids`; with `with_prompt` (echo), the prompt's come first
        (the first prompt token has none: nothing precedes it)."""
        if prep.params.logprobs is None:
            return None
        rows: list[tuple[int, dict[int, Logprob] | None]] = []
        if with_prompt and self._echoes(prep):
            prompt_entries = prep.prompt_logprobs.get(index // prep.params.n) or []
            rows += [
                (token_id, prompt_entries[pos] if pos < len(prompt_entries) else None)
                for pos, token_id in enumerate(prep.prompt_of(index).token_ids)
            ]
        rows += zip(token_ids, entries, strict=False)
        k = max(prep.params.logprobs, 0)
        result = CompletionLogprobs()
        offset = self._text_offsets.get(index, 0)
        for token_id, entry in rows:
            own = entry.get(token_id) if entry else None
            token = (
                own.decoded_token
                if own and own.decoded_token is not None
                else str(self.tokenizer.decode([token_id]))
            )
            result.tokens.append(token)
            result.token_logprobs.append(own.logprob if own else None)
            result.text_offset.append(offset)
            offset += len(token)
            result.top_logprobs.append(
                {lp.decoded_token or "": lp.logprob for _, lp in _top(entry, token_id, k)}
                if entry is not None
                else None
            )
        self._text_offsets[index] = offset
        return result

    def full(self, prep: _Prepared, model: str, choices: list[_Choice], usage: UsageInfo) -> str:
        want_ids = prep.body.return_token_ids
        return CompletionResponse(
            id=prep.request_id,
            model=model,
            usage=usage,
            choices=[
                CompletionResponseChoice(
                    index=i,
                    text=self._echo(prep, i) + c.text,
                    logprobs=self._logprobs(prep, c.token_ids, c.logprobs, i, with_prompt=True),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_token_ids=prep.prompt_of(i).token_ids if want_ids else None,
                    token_ids=c.token_ids if want_ids else None,
                )
                for i, c in enumerate(choices)
            ],
        ).model_dump_json()

    @staticmethod
    def _echoes(prep: _Prepared) -> bool:
        return isinstance(prep.body, CompletionRequest) and prep.body.echo

    def _echo(self, prep: _Prepared, index: int) -> str:
        """The prompt's text when the request asked for `echo` (decoded if sent as ids)."""
        if not self._echoes(prep):
            return ""
        prompt = prep.prompt_of(index)
        return (
            prompt.text if prompt.text is not None else str(self.tokenizer.decode(prompt.token_ids))
        )

    def first_chunks(self, prep: _Prepared, model: str) -> list[str]:
        return []

    def chunk(
        self, prep: _Prepared, model: str, delta: CompletionOutput, usage: UsageInfo | None
    ) -> str | None:
        if not (delta.text or delta.finish_reason or delta.token_ids):
            return None
        want_ids = prep.body.return_token_ids
        first = delta.index not in self._started
        self._started.add(delta.index)
        choice = CompletionResponseChoice(
            index=delta.index,
            text=(self._echo(prep, delta.index) if first else "") + delta.text,
            logprobs=self._logprobs(
                prep, delta.token_ids, delta.logprobs or [], delta.index, with_prompt=first
            ),
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
            # The prompt's ids (and its echo) go with each choice's first chunk only.
            prompt_token_ids=prep.prompt_of(delta.index).token_ids if want_ids and first else None,
            token_ids=delta.token_ids if want_ids else None,
        )
        return CompletionStreamResponse(
            id=prep.request_id, model=model, choices=[choice], usage=usage
        ).model_dump_json()

    def usage_chunk(self, prep: _Prepared, model: str, usage: UsageInfo) -> str:
        return CompletionStreamResponse(
            id=prep.request_id, model=model, choices=[], usage=usage
        ).model_dump_json()


class _ChatFormat:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def _logprobs(
        self, prep: _Prepared, token_ids: list[int], entries: list[dict[int, Logprob]]
    ) -> ChatLogprobs | None:
        if prep.params.logprobs is None:
            return None
        k = max(prep.params.logprobs, 0)
        content = []
        for token_id, entry in zip(token_ids, entries, strict=False):
            sampled = entry.get(token_id)
            token = self._text(token_id, sampled)
            content.append(
                ChatLogprobContent(
                    token=token,
                    logprob=sampled.logprob if sampled else float("-inf"),
                    bytes=list(token.encode()),
                    top_logprobs=[
                        ChatTopLogprob(
                            token=self._text(tid, lp),
                            logprob=lp.logprob,
                            bytes=list(self._text(tid, lp).encode()),
                        )
                        for tid, lp in _top(entry, token_id, k)
                    ],
                )
            )
        return ChatLogprobs(content=content)

    def _text(self, token_id: int, logprob: Logprob | None) -> str:
        if logprob is not None and logprob.decoded_token is not None:
            return logprob.decoded_token
        return str(self.tokenizer.decode([token_id]))

    def full(self, prep: _Prepared, model: str, choices: list[_Choice], usage: UsageInfo) -> str:
        want_ids = prep.body.return_token_ids
        return ChatCompletionResponse(
            id=prep.request_id,
            model=model,
            usage=usage,
            choices=[
                ChatCompletionResponseChoice(
                    index=i,
                    message=ChatMessage(role="assistant", content=c.text),
                    logprobs=self._logprobs(prep, c.token_ids, c.logprobs),
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_token_ids=prep.prompts[0].token_ids if want_ids else None,
                    token_ids=c.token_ids if want_ids else None,
                )
                for i, c in enumerate(choices)
            ],
        ).model_dump_json()

    def first_chunks(self, prep: _Prepared, model: str) -> list[str]:
        want_ids = prep.body.return_token_ids
        return [
            ChatCompletionStreamResponse(
                id=prep.request_id,
                model=model,
                choices=[
                    ChatCompletionStreamChoice(
                        index=i,
                        delta=DeltaMessage(role="assistant", content=""),
                        prompt_token_ids=prep.prompts[0].token_ids if want_ids else None,
                    )
                ],
            ).model_dump_json()
            for i in range(prep.num_choices)
        ]

    def chunk(
        self, prep: _Prepared, model: str, delta: CompletionOutput, usage: UsageInfo | None
    ) -> str | None:
        if not (delta.text or delta.finish_reason or delta.token_ids):
            return None
        choice = ChatCompletionStreamChoice(
            index=delta.index,
            delta=DeltaMessage(content=delta.text),
            logprobs=self._logprobs(prep, delta.token_ids, delta.logprobs or []),
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
            token_ids=delta.token_ids if prep.body.return_token_ids else None,
        )
        return ChatCompletionStreamResponse(
            id=prep.request_id, model=model, choices=[choice], usage=usage
        ).model_dump_json()

    def usage_chunk(self, prep: _Prepared, model: str, usage: UsageInfo) -> str:
        return ChatCompletionStreamResponse(
            id=prep.request_id, model=model, choices=[], usage=usage
        ).model_dump_json()
