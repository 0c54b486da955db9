"""The OpenAI shapes of logprobs: completions (parallel lists with text offsets) and chat (one
object per token with its top alternatives), built from the engine's `Logprob` entries."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from fleetserve.engine.logprobs import token_text, top_logprobs
from fleetserve.engine.request_output import Logprob
from fleetserve.openai.protocol import (
    ChatLogprobContent,
    ChatLogprobs,
    ChatTopLogprob,
    CompletionLogprobs,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = ["LogprobRow", "chat_logprobs", "completion_logprobs"]

LogprobRow = tuple[int, dict[int, Logprob] | None]
"""One position to report: its token id and its entry (None where nothing precedes it)."""


def completion_logprobs(
    rows: Sequence[LogprobRow], k: int, tokenizer: PreTrainedTokenizerBase, text_offset: int
) -> tuple[CompletionLogprobs, int]:
    """The completions `logprobs` object of `rows`, whose text starts at `text_offset` in the
    choice's text; returns it with the offset after the last token (for the next chunk).

    A position without an entry gets null `token_logprobs` and `top_logprobs`.
    """
    result = CompletionLogprobs()
    offset = text_offset
    for token_id, entry in rows:
        own = entry.get(token_id) if entry else None
        token = token_text(token_id, own, tokenizer)
        result.tokens.append(token)
        result.token_logprobs.append(own.logprob if own else None)
        result.text_offset.append(offset)
        offset += len(token)
        result.top_logprobs.append(
            {token_text(tid, lp, tokenizer): lp.logprob for tid, lp in top_logprobs(entry, k)}
            if entry is not None
            else None
        )
    return result, offset


def chat_logprobs(
    token_ids: Sequence[int],
    entries: Sequence[dict[int, Logprob]],
    k: int,
    tokenizer: PreTrainedTokenizerBase,
) -> ChatLogprobs:
    """The chat `logprobs` object: per generated token its text, logprob, UTF-8 bytes and the
    top-k alternatives (a token missing from its entry gets logprob -inf)."""
    content = []
    for token_id, entry in zip(token_ids, entries, strict=False):
        sampled = entry.get(token_id)
        token = token_text(token_id, sampled, tokenizer)
        alternatives = []
        for tid, lp in top_logprobs(entry, k):
            text = token_text(tid, lp, tokenizer)
            alternatives.append(
                ChatTopLogprob(token=text, logprob=lp.logprob, bytes=list(text.encode()))
            )
        content.append(
            ChatLogprobContent(
                token=token,
                logprob=sampled.logprob if sampled else float("-inf"),
                bytes=list(token.encode()),
                top_logprobs=alternatives,
            )
        )
    return ChatLogprobs(content=content)
