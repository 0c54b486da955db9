"""OpenAI-compatible request and response bodies (pydantic), with OpenAI's field names.

Requests also accept vLLM's extra sampling fields (`top_k`, `min_p`, `repetition_penalty`,
`min_tokens`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`, `return_token_ids`);
unknown fields are ignored, as vLLM does. The models only describe the bodies: the engine's
server turns a request into its `SamplingParams` (`fleetserve/server/sampling.py`), so this
module loads without the engine and the router can validate and forward the same bodies.

Limits are OpenAI's (and vLLM's): `n` in [1, 128], completions `logprobs` and chat
`top_logprobs` in [0, 20]; they are in the published schema (`openapi.py`) too. The sampling
fields' ranges are the engine's (`SamplingParams` validates them; the schema only documents
them, and the suite's fuzzer checks that the two agree). Fields of
features not built yet (`functions`, `tool_choice: "auto"`, streamed tool calls, ...) are
declared so that a request using them is refused by name (`unsupported_feature`) instead of
silently ignored.

Structured output: `response_format` (`json_object`, `json_schema`), vLLM's `structured_outputs`
object and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`
fields, and chat `tools` with `tool_choice: "required"` or a named function (the grammar forces
the call; the response carries `tool_calls`). The server turns them into one constraint
(`fleetserve/server/serving_structured.py`); at most one may be given.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
)

MAX_N = 128
"""Most sequences one request may ask for (OpenAI's limit)."""
MAX_LOGPROBS = 20
"""Most top logprobs per token (OpenAI's and vLLM's limit)."""
DEFAULT_MAX_PROMPTS_PER_REQUEST = 128
"""Prompts one completions request may batch unless the server says otherwise."""


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now_s() -> int:
    return int(time.time())


class OpenAIModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


# -- errors, models, usage ------------------------------------------------------------------


class ErrorInfo(OpenAIModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(OpenAIModel):
    error: ErrorInfo


class ModelCard(OpenAIModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now_s)
    owned_by: str = "fleetserve"
    root: str | None = None
    parent: str | None = None
    """For a LoRA adapter: the base model it runs on (None for the base model itself)."""
    max_model_len: int | None = None


class ModelList(OpenAIModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class PromptTokensDetails(OpenAIModel):
    cached_tokens: int = 0


class UsageInfo(OpenAIModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class JsonSchemaFormat(OpenAIModel):
    """`response_format.json_schema`: the schema the output must follow."""

    model_config = ConfigDict(extra="ignore", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(OpenAIModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(OpenAIModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ChatTool(OpenAIModel):
    type: Literal["function"] = "function"
    function: FunctionDefinition


class NamedFunction(OpenAIModel):
    name: str


class NamedToolChoice(OpenAIModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class StreamOptions(OpenAIModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


# -- requests -------------------------------------------------------------------------------


class SamplingRequest(OpenAIModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: int = Field(1, json_schema_extra={"minimum": 1, "maximum": MAX_N})
    temperature: float | None = Field(None, json_schema_extra={"minimum": 0})
    top_p: float | None = Field(None, json_schema_extra={"exclusiveMinimum": 0, "maximum": 1})
    stop: str | list[str] | None = None
    seed: int | None = Field(None, json_schema_extra={"minimum": -(2**63), "maximum": 2**64 - 1})
    presence_penalty: float = Field(0.0, json_schema_extra={"minimum": -2, "maximum": 2})
    frequency_penalty: float = Field(0.0, json_schema_extra={"minimum": -2, "maximum": 2})
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM extensions
    top_k: int | None = Field(None, json_schema_extra={"minimum": -1, "maximum": 2**63 - 1})
    min_p: float | None = Field(None, json_schema_extra={"minimum": 0, "maximum": 1})
    repetition_penalty: float | None = Field(None, json_schema_extra={"exclusiveMinimum": 0})
    min_tokens: int = Field(0, json_schema_extra={"minimum": 0, "maximum": 2**63 - 1})
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    priority: int = 0
    cache_salt: str | None = None
    kv_transfer_params: dict[str, Any] | None = Field(
        None,
        description="Disaggregated serving (vLLM's protocol): {'do_remote_decode': true} to a "
        "prefill engine; its response's kv_transfer_params to a decode engine.",
    )
    response_format: ResponseFormat | None = None
    structured_outputs: dict[str, Any] | None = Field(
        None,
        description="vLLM's constraint object: exactly one of json (a schema), json_object, "
        "regex, choice (a list of strings), grammar (EBNF).",
    )
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @field_validator("n")
    @classmethod
    def _check_n(cls, n: int) -> int:
        if not 1 <= n <= MAX_N:
            raise ValueError(f"n must be an integer in [1, {MAX_N}], got {n}")
        return n

    def unsupported_feature(self) -> tuple[str, str] | None:
        """(field, feature) when the body asks for a feature this server does not have yet."""
        return None

    @property
    def include_usage_in_stream(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage_in_stream(self) -> bool:
        """Every content chunk carries the usage so far (vLLM's `continuous_usage_stats`)."""
        options = self.stream_options
        return options is not None and options.include_usage and options.continuous_usage_stats


class CompletionRequest(SamplingRequest):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, json_schema_extra={"minimum": 1})
    logprobs: int | None = Field(None, json_schema_extra={"minimum": 0, "maximum": MAX_LOGPROBS})
    echo: bool = False
    suffix: str | None = None

    @field_validator("logprobs")
    @classmethod
    def _check_logprobs(cls, logprobs: int | None) -> int | None:
        return _check_logprobs("logprobs", logprobs)

    def prompt_list(self) -> list[str | list[int]]:
        """The prompts of this request: one string or id list, or a batch of either.

        Raises:
            ValueError: an empty prompt or batch, `suffix`, or `echo` with `logprobs` and n > 1.
        """
        if self.suffix:
            raise ValueError("suffix is not supported")
        if self.echo and self.logprobs is not None and self.n != 1:
            raise ValueError("echo with logprobs needs n=1 (the prompt's logprobs are shared)")
        prompt = self.prompt
        batch: list[str | list[int]]
        if isinstance(prompt, str):
            batch = [prompt]
        elif prompt and isinstance(prompt[0], str | list):
            batch = [p for p in prompt if isinstance(p, str | list)]
        else:
            batch = [[t for t in prompt if isinstance(t, int)]]
        if not all(batch):
            raise ValueError("prompt must not be empty (nor hold an empty prompt)")
        return batch


class ChatContentPart(OpenAIModel):
    """A part of a message's content; only `text` parts are served (no multimodal input)."""

    type: str
    text: str | None = None


class ChatMessageParam(OpenAIModel):
    """One message of a conversation: its role and text (other message fields are ignored)."""

    role: Literal["system", "user", "assistant", "tool", "developer"]
    content: str | list[ChatContentPart] | None = None


def messages_as_dicts(messages: list[ChatMessageParam]) -> list[dict[str, Any]]:
    """The plain `{role, content}` dicts the chat template takes."""
    return [m.model_dump(exclude_none=True) for m in messages]


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessageParam] = Field(min_length=1)
    max_tokens: int | None = Field(None, json_schema_extra={"minimum": 1})
    max_completion_tokens: int | None = Field(None, json_schema_extra={"minimum": 1})
    logprobs: bool = False
    top_logprobs: int | None = Field(
        None, json_schema_extra={"minimum": 0, "maximum": MAX_LOGPROBS}
    )
    add_generation_prompt: bool = True
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="'none', 'required' or a named function ('auto' is refused)."
    )
    functions: list[dict[str, Any]] | None = Field(None, description="Refused (deprecated).")
    function_call: str | dict[str, Any] | None = Field(None, description="Only 'none' for now.")

    @field_validator("top_logprobs")
    @classmethod
    def _check_top_logprobs(cls, top_logprobs: int | None) -> int | None:
        return _check_logprobs("top_logprobs", top_logprobs)

    def unsupported_feature(self) -> tuple[str, str] | None:
        if self.functions:
            return "functions", "deprecated function calling (use tools)"
        if self.function_call not in (None, "none"):
            return "function_call", "deprecated function calling (use tools)"
        if self.tools and self.tool_choice in (None, "auto"):
            return (
                "tool_choice",
                "automatic tool choice ('auto'): set 'required' or a named function",
            )
        if self.tools and self.tool_choice != "none" and self.stream:
            return "stream", "streamed tool calls: call tools with stream false"
        return super().unsupported_feature()

    @property
    def forced_tools(self) -> list[ChatTool] | None:
        """The tools the output must call: all of them ('required'), the named one, or None
        (no tools, or 'none')."""
        if not self.tools or self.tool_choice in (None, "none", "auto"):
            return None
        choice = self.tool_choice
        if isinstance(choice, NamedToolChoice):
            return [t for t in self.tools if t.function.name == choice.function.name]
        return list(self.tools)


def _check_logprobs(name: str, value: int | None) -> int | None:
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}], got {value}")
    return value


class TokenizeRequest(OpenAIModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessageParam] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class TokenizeResponse(OpenAIModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeRequest(OpenAIModel):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(OpenAIModel):
    prompt: str


# -- completion responses -------------------------------------------------------------------


class CompletionLogprobs(OpenAIModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class _ChoiceEnd(OpenAIModel):
    """Fields every choice ends with; the token id lists only with `return_token_ids`."""

    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class CompletionResponseChoice(_ChoiceEnd):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None


class _Response(OpenAIModel):
    """The envelope every completion/chat response and stream chunk shares."""

    id: str
    created: int = Field(default_factory=now_s)
    model: str
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None
    """A prefill leg's answer: what its decode leg must send (vLLM's P/D protocol)."""


class CompletionResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionResponseChoice]


# -- chat responses -------------------------------------------------------------------------


class ChatTopLogprob(OpenAIModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobContent(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIModel):
    content: list[ChatLogprobContent] | None = None


class FunctionCall(OpenAIModel):
    name: str
    arguments: str
    """The call's arguments as JSON text (OpenAI's shape)."""


class ToolCall(OpenAIModel):
    id: str = Field(default_factory=lambda: random_id("call"))
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(OpenAIModel):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None
    """Only in answers that call tools (the key is left out otherwise, as OpenAI does)."""

    @model_serializer(mode="wrap")
    def _omit_absent_tool_calls(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data: dict[str, Any] = handler(self)
        if data.get("tool_calls") is None:
            data.pop("tool_calls", None)
        return data


class DeltaMessage(OpenAIModel):
    role: str | None = None
    content: str | None = None


class ChatCompletionResponseChoice(_ChoiceEnd):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(_Response):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatCompletionResponseChoice]


class ChatCompletionStreamChoice(_ChoiceEnd):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None


class ChatCompletionStreamResponse(_Response):
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatCompletionStreamChoice]


class CompletionStreamResponse(_Response):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionResponseChoice]


class LoadLoRAAdapterRequest(OpenAIModel):
    """`POST /v1/load_lora_adapter` (vLLM's body)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_path: str = Field(min_length=1, max_length=4096)


class UnloadLoRAAdapterRequest(OpenAIModel):
    """`POST /v1/unload_lora_adapter` (vLLM's body; `lora_int_id`, if given, must match)."""

    lora_name: str = Field(min_length=1, max_length=256)
    lora_int_id: int | None = None
