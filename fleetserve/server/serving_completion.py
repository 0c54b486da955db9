"""POST /v1/completions: text or token-id prompts (one or a batch), `echo`, completion logprobs.

`create_completion` parses the body, encodes each prompt and hands the request to the shared
pipeline (`serving.py`); `CompletionFormat` shapes its choices: the echoed prompt goes before
a choice's first text (with its prompt logprobs first when `echo` and `logprobs` are set), and
`text_offset`s run on across the chunks of a stream.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from fleetserve.engine.request_output import CompletionOutput, Logprob
from fleetserve.engine.tokenizer import encode_prompt
from fleetserve.openai.errors import RequestError, parse_body, value_error
from fleetserve.openai.protocol import (
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamResponse,
    UsageInfo,
)
from fleetserve.server.logprobs import LogprobRow, completion_logprobs
from fleetserve.server.sampling import completion_sampling_params
from fleetserve.server.serving import OpenAIServing
from fleetserve.server.serving_types import (
    ChoiceState,
    PreparedRequest,
    choice_end,
    envelope,
    has_output,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["CompletionFormat", "create_completion"]


async def create_completion(serving: OpenAIServing, request: web.Request) -> web.StreamResponse:
    """The completions endpoint: 400 (naming the field) for a bad body, else JSON or SSE."""
    body = await parse_body(request, CompletionRequest)
    serving.check_body(body)
    try:
        prompts = body.prompt_list()
    except ValueError as exc:
        raise value_error(exc, "prompt") from exc
    limit = serving.max_prompts_per_request
    if len(prompts) > limit:
        raise RequestError(
            400,
            f"prompt holds {len(prompts)} prompts, but this server takes at most {limit} per "
            "request (--max-prompts-per-request); split the batch",
            param="prompt",
        )
    if body.echo:
        serving.require_tokenizer("echo (it returns the prompt's text)", "echo")
    encoded: list[tuple[list[int], str | None]] = [
        (encode_prompt(serving.require_tokenizer("text prompts", "prompt"), p), p)
        if isinstance(p, str)
        else (list(p), None)
        for p in prompts
    ]
    try:
        params = completion_sampling_params(body, serving.generation_defaults)
    except ValueError as exc:
        raise value_error(exc) from exc
    prepared = serving.prepare(request, body, encoded, params, "cmpl")
    response_format = CompletionFormat(serving.tokenizer, serving.response_model(body.model))
    return await serving.respond(request, prepared, response_format)


class CompletionFormat:
    """Per request: it keeps each choice's text offset across stream chunks."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase | None, model_name: str) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self._text_offsets: dict[int, int] = {}
        self._started: set[int] = set()

    def full(self, prepared: PreparedRequest, choices: list[ChoiceState], usage: UsageInfo) -> str:
        return CompletionResponse(
            **envelope(prepared, self.model_name, usage, final=True),
            choices=[
                CompletionResponseChoice(
                    index=i,
                    text=self._echo(prepared, i) + choice.text,
                    logprobs=self._logprobs(
                        prepared, i, choice.token_ids, choice.logprobs, with_prompt=True
                    ),
                    **choice_end(prepared, i, choice, with_prompt_ids=True),
                )
                for i, choice in enumerate(choices)
            ],
        ).model_dump_json()

    def first_chunks(self, prepared: PreparedRequest) -> list[str]:
        return []

    def chunk(
        self,
        prepared: PreparedRequest,
        choice_index: int,
        delta: CompletionOutput,
        usage: UsageInfo | None,
    ) -> str | None:
        if not has_output(delta):
            return None
        first = choice_index not in self._started
        self._started.add(choice_index)
        choice = CompletionResponseChoice(
            index=choice_index,
            text=(self._echo(prepared, choice_index) if first else "") + delta.text,
            logprobs=self._logprobs(
                prepared, choice_index, delta.token_ids, delta.logprobs or [], with_prompt=first
            ),
            # The prompt's ids (and its echo) go with each choice's first chunk only.
            **choice_end(prepared, choice_index, delta, with_prompt_ids=first),
        )
        return CompletionStreamResponse(
            **envelope(prepared, self.model_name, usage, final=bool(delta.finish_reason)),
            choices=[choice],
        ).model_dump_json()

    def usage_chunk(self, prepared: PreparedRequest, usage: UsageInfo) -> str:
        return CompletionStreamResponse(
            **envelope(prepared, self.model_name, usage, final=False), choices=[]
        ).model_dump_json()

    @staticmethod
    def _echoes(prepared: PreparedRequest) -> bool:
        return isinstance(prepared.body, CompletionRequest) and prepared.body.echo

    def _echo(self, prepared: PreparedRequest, choice_index: int) -> str:
        """The prompt's text when the request asked for `echo` (decoded if sent as ids)."""
        if not self._echoes(prepared):
            return ""
        prompt = prepared.prompt_of(choice_index)
        if prompt.text is not None:
            return prompt.text
        assert self.tokenizer is not None, "echo needs a tokenizer (refused earlier)"
        return str(self.tokenizer.decode(prompt.token_ids))

    def _logprobs(
        self,
        prepared: PreparedRequest,
        choice_index: int,
        token_ids: list[int],
        entries: list[dict[int, Logprob]],
        *,
        with_prompt: bool,
    ) -> CompletionLogprobs | None:
        """The logprobs of `token_ids`; with `with_prompt` (echo), the prompt's come first
        (the first prompt token has none: nothing precedes it)."""
        if prepared.params.logprobs is None:
            return None
        rows: list[LogprobRow] = []
        if with_prompt and self._echoes(prepared):
            prompt_entries = prepared.prompt_logprobs.get(choice_index // prepared.params.n) or []
            rows += [
                (token_id, prompt_entries[pos] if pos < len(prompt_entries) else None)
                for pos, token_id in enumerate(prepared.prompt_of(choice_index).token_ids)
            ]
        rows += zip(token_ids, entries, strict=False)
        assert self.tokenizer is not None, "logprobs need a tokenizer (refused earlier)"
        top_k = prepared.params.logprobs
        result, self._text_offsets[choice_index] = completion_logprobs(
            rows, top_k, self.tokenizer, self._text_offsets.get(choice_index, 0)
        )
        return result
