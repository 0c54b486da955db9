"""POST /v1/chat/completions: messages through the chat template, chat-shaped choices.

`create_chat_completion` renders the conversation (`engine/chat.py`), sizes the default
`max_tokens` to the context left after the prompt and hands the request to the shared
pipeline (`serving.py`); `ChatFormat` shapes messages, deltas and chat logprobs. A stream
opens with one role chunk per choice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from fleetserve.engine.chat import apply_chat_template
from fleetserve.engine.request_output import CompletionOutput, Logprob
from fleetserve.openai.errors import RequestError, parse_body, value_error
from fleetserve.openai.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatLogprobs,
    ChatMessage,
    DeltaMessage,
    UsageInfo,
    messages_as_dicts,
)
from fleetserve.server.logprobs import chat_logprobs
from fleetserve.server.sampling import chat_sampling_params
from fleetserve.server.serving import OpenAIServing
from fleetserve.server.serving_structured import parse_tool_calls
from fleetserve.server.serving_types import (
    ChoiceState,
    PreparedRequest,
    choice_end,
    envelope,
    has_output,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["ChatFormat", "create_chat_completion"]


async def create_chat_completion(
    serving: OpenAIServing, request: web.Request
) -> web.StreamResponse:
    """The chat endpoint: 400 (naming the field) for a bad body, else JSON or SSE."""
    body = await parse_body(request, ChatCompletionRequest)
    serving.check_body(body)
    tokenizer = serving.require_tokenizer("chat messages", "messages")
    try:
        prompt_ids = apply_chat_template(
            tokenizer,
            messages_as_dicts(body.messages),
            add_generation_prompt=body.add_generation_prompt,
        )
    except ValueError as exc:
        raise RequestError(400, str(exc), param="messages") from exc
    context_left = max(1, serving.max_model_len - len(prompt_ids))
    try:
        params = chat_sampling_params(
            body, default_max_tokens=context_left, defaults=serving.generation_defaults
        )
    except ValueError as exc:
        raise value_error(exc) from exc
    prepared = serving.prepare(request, body, [(prompt_ids, None)], params, "chatcmpl")
    response_format = ChatFormat(tokenizer, serving.response_model(body.model), body)
    return await serving.respond(request, prepared, response_format)


class ChatFormat:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        model_name: str,
        body: ChatCompletionRequest | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.body = body
        """The request, read for the tool calls it forces (their output becomes `tool_calls`)."""

    def full(self, prepared: PreparedRequest, choices: list[ChoiceState], usage: UsageInfo) -> str:
        return ChatCompletionResponse(
            **envelope(prepared, self.model_name, usage, final=True),
            choices=[self._choice(prepared, i, choice) for i, choice in enumerate(choices)],
        ).model_dump_json()

    def _choice(
        self, prepared: PreparedRequest, index: int, choice: ChoiceState
    ) -> ChatCompletionResponseChoice:
        end = choice_end(prepared, index, choice, with_prompt_ids=True)
        tool_calls = None if self.body is None else parse_tool_calls(self.body, choice.text)
        if tool_calls is not None:
            message = ChatMessage(role="assistant", content=None, tool_calls=tool_calls)
            end["finish_reason"] = "tool_calls"
        else:
            message = ChatMessage(role="assistant", content=choice.text)
        return ChatCompletionResponseChoice(
            index=index,
            message=message,
            logprobs=self._logprobs(prepared, choice.token_ids, choice.logprobs),
            **end,
        )

    def first_chunks(self, prepared: PreparedRequest) -> list[str]:
        want_ids = prepared.return_token_ids
        return [
            ChatCompletionStreamResponse(
                id=prepared.request_id,
                model=self.model_name,
                choices=[
                    ChatCompletionStreamChoice(
                        index=i,
                        delta=DeltaMessage(role="assistant", content=""),
                        prompt_token_ids=prepared.prompt_of(i).token_ids if want_ids else None,
                    )
                ],
            ).model_dump_json()
            for i in range(prepared.num_choices)
        ]

    def chunk(
        self,
        prepared: PreparedRequest,
        choice_index: int,
        delta: CompletionOutput,
        usage: UsageInfo | None,
    ) -> str | None:
        if not has_output(delta):
            return None
        choice = ChatCompletionStreamChoice(
            index=choice_index,
            delta=DeltaMessage(content=delta.text),
            logprobs=self._logprobs(prepared, delta.token_ids, delta.logprobs or []),
            **choice_end(prepared, choice_index, delta, with_prompt_ids=False),
        )
        return ChatCompletionStreamResponse(
            **envelope(prepared, self.model_name, usage, final=bool(delta.finish_reason)),
            choices=[choice],
        ).model_dump_json()

    def usage_chunk(self, prepared: PreparedRequest, usage: UsageInfo) -> str:
        return ChatCompletionStreamResponse(
            **envelope(prepared, self.model_name, usage, final=False), choices=[]
        ).model_dump_json()

    def _logprobs(
        self, prepared: PreparedRequest, token_ids: list[int], entries: list[dict[int, Logprob]]
    ) -> ChatLogprobs | None:
        if prepared.params.logprobs is None:
            return None
        top_k = prepared.params.logprobs
        return chat_logprobs(token_ids, entries, top_k, self.tokenizer)
