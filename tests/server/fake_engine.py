"""A scripted `EngineClient` for in-process server tests, and an aiohttp test-client runner.

`FakeEngineClient` has the real parts an engine client has in the API process — the bundled
model's config and tokenizer, `validate_prompt`, admission by waiting sequences — and replaces
only the engine core: each `generate` call's DELTA `RequestOutput`s come from a script. So the
tests exercise the real protocol, pipeline and formatting code in milliseconds.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.engine_client import EngineDeadError, check_waiting_bound
from fleetserve.engine.lora.request import LoRARequest
from fleetserve.engine.metrics import StatsLogger
from fleetserve.engine.request_output import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestOutput,
)
from fleetserve.engine.sampling_params import SamplingParams
from fleetserve.engine.validation import KVCapacity, validate_prompt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

T = TypeVar("T")

MODEL_NAME = "smol"
"""The served model name of the in-process apps."""
IN_PROCESS_MAX_MODEL_LEN = 128


@dataclass(frozen=True)
class GenerateCall:
    """One `generate` call as the server made it."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prompt: str | None
    priority: int
    cache_salt: str | None
    admit: bool
    kv_transfer_params: dict[str, Any] | None = None
    lora_request: LoRARequest | None = None


Script = Callable[[GenerateCall], Sequence[RequestOutput | BaseException]]
"""A call → the outputs its iterator yields (an exception is raised at that point)."""


def top_entry(token_id: int, tokenizer: Any, *, logprob: float = -0.5) -> dict[int, Logprob]:
    """A scripted logprob entry: the token at rank 1, then two alternatives at ranks 2 and 3."""
    return {
        tid: Logprob(logprob - rank + 1, rank=rank, decoded_token=str(tokenizer.decode([tid])))
        for rank, tid in enumerate((token_id, token_id + 1, token_id + 2), start=1)
    }


def token_outputs(
    call: GenerateCall,
    tokens: Sequence[Sequence[int]],
    tokenizer: Any,
    *,
    finish_reason: str = "length",
    stop_reason: int | str | None = None,
    num_cached_tokens: int = 0,
    prompt_logprobs: PromptLogprobs | None = None,
) -> list[RequestOutput]:
    """Deltas as the output processor makes them: each step one token per running sequence;
    a sequence that finished keeps appearing (empty) while its siblings run; logprob entries
    (`top_entry`) when the call asked for logprobs; prompt logprobs in the first output only."""
    want_logprobs = call.params.logprobs is not None
    outputs = []
    for step in range(max(len(t) for t in tokens)):
        completions = []
        for index, sequence in enumerate(tokens):
            new = list(sequence[step : step + 1])
            done = step >= len(sequence) - 1
            completions.append(
                CompletionOutput(
                    index=index,
                    text="".join(str(tokenizer.decode([t])) for t in new),
                    token_ids=new,
                    logprobs=[top_entry(t, tokenizer) for t in new] if want_logprobs else None,
                    finish_reason=finish_reason if done else None,
                    stop_reason=stop_reason if done else None,
                )
            )
        outputs.append(
            RequestOutput(
                request_id=call.request_id,
                prompt=call.prompt,
                prompt_token_ids=call.prompt_token_ids,
                outputs=completions,
                finished=all(c.finish_reason is not None for c in completions),
                num_cached_tokens=num_cached_tokens,
                prompt_logprobs=prompt_logprobs if step == 0 else None,
            )
        )
    return outputs


@dataclass
class FakeEngineClient:
    """An `EngineClient` whose engine core is a script (default: tokens 100, 101, 102 for each
    of the call's n sequences, finishing by length)."""

    config: EngineConfig
    tokenizer: PreTrainedTokenizerBase
    script: Script | None = None
    max_waiting_requests: int = 16
    stats_logger: StatsLogger = field(default_factory=StatsLogger)
    healthy: bool = True
    waiting: int = 0
    """Sequences that pretend to wait (admission counts them)."""
    kv_capacity: KVCapacity | None = None
    """Validated in `generate` as the real client does (None: unknown, not checked)."""
    kv_connector: dict[str, Any] | None = None
    """A colocated engine (no KV connector)."""
    step_delay_s: float = 0.0
    """Pause before each output (0: just yield to the event loop)."""
    calls: list[GenerateCall] = field(default_factory=list)
    admissions: list[int] = field(default_factory=list)
    """The sequence counts of the admissions granted (`check_admission`)."""
    aborted: list[str] = field(default_factory=list)
    live: set[str] = field(default_factory=set)
    started: bool = False
    shut_down: bool = False

    @property
    def is_healthy(self) -> bool:
        return self.healthy

    @property
    def num_waiting(self) -> int:
        return self.waiting

    async def start(self, timeout_s: float) -> None:
        self.started = True

    async def shutdown(self) -> None:
        self.shut_down = True

    def check_admission(self, num_sequences: int = 1) -> None:
        if not self.healthy:
            raise EngineDeadError("the engine core process is not running")
        check_waiting_bound(self.waiting, num_sequences, self.max_waiting_requests)
        self.admissions.append(num_sequences)

    def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        prompt: str | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
        admit: bool = True,
        lora_request: LoRARequest | None = None,
    ) -> AsyncIterator[RequestOutput]:
        if admit:
            self.check_admission(params.n)
        elif not self.healthy:
            raise EngineDeadError("the engine core process is not running")
        validate_prompt(prompt_token_ids, params, self.config, self.kv_capacity)
        call = GenerateCall(
            request_id, prompt_token_ids, params, prompt, priority, cache_salt, admit,
            kv_transfer_params, lora_request,
        )  # fmt: skip
        self.calls.append(call)
        self.live.add(request_id)
        script = self.script or self._default_script
        return self._stream(call, list(script(call)))

    def abort(self, request_id: str) -> None:
        if request_id in self.live:
            self.live.discard(request_id)
            self.aborted.append(request_id)

    def _default_script(self, call: GenerateCall) -> list[RequestOutput]:
        return token_outputs(call, [[100, 101, 102]] * call.params.n, self.tokenizer)

    async def _stream(
        self, call: GenerateCall, items: list[RequestOutput | BaseException]
    ) -> AsyncIterator[RequestOutput]:
        for item in items:
            await asyncio.sleep(self.step_delay_s)  # lets the prompts of a batch interleave
            if isinstance(item, BaseException):
                self.live.discard(call.request_id)
                raise item
            if item.finished:
                self.live.discard(call.request_id)
            yield item


def run_client(app: web.Application, scenario: Callable[[TestClient[Any, Any]], Awaitable[T]]) -> T:
    """Serve `app` in-process (aiohttp's TestServer) and run `scenario` against it."""

    async def main() -> T:
        async with TestClient(TestServer(app)) as client:
            return await scenario(client)

    return asyncio.run(main())


def sse_events(text: str) -> list[Any]:
    """The JSON payloads of an SSE body, with the final `[DONE]` checked and dropped."""
    events = [line[len("data: ") :] for line in text.split("\n\n") if line.strip()]
    assert events[-1] == "[DONE]", events[-1]
    return [json.loads(event) for event in events[:-1]]
