"""Front-end logprob shaping, in one module: the core's rows → `Logprob` entries → OpenAI bodies.

The engine core sends `LogprobsLists` (per row: the row's own token first — the sampled one, or
the prompt's next token — then the top-k, with the own token's rank). `OutputProcessor` turns
each row into one `{token id: Logprob}` entry here (`logprob_entries`), which is what
`RequestOutput`s carry; the server turns entries into the OpenAI completion shape
(`completion_logprobs`: parallel lists with text offsets) or the chat shape (`chat_logprobs`:
one object per token with its top alternatives). A token's text comes from the entry
(`decoded_token`, decoded once by the output processor) and is decoded here only when a
position has no entry (the first prompt token, which nothing precedes).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from fleetserve.engine.core.outputs import LogprobsLists
from fleetserve.engine.request_output import Logprob, PromptLogprobs, SampleLogprobs
from fleetserve.openai.protocol import (
    ChatLogprobContent,
    ChatLogprobs,
    ChatTopLogprob,
    CompletionLogprobs,
)

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "chat_logprobs",
    "completion_logprobs",
    "logprob_entries",
    "prompt_logprobs_entries",
    "sampled_logprob_sum",
    "token_text",
    "top_logprobs",
]

LogprobRow = tuple[int, dict[int, Logprob] | None]
"""One position to report: its token id and its entry (None where nothing precedes it)."""


# -- core rows → entries (OutputProcessor) ------------------------------------------------------


def logprob_entries(rows: LogprobsLists, tokenizer: PreTrainedTokenizerBase) -> SampleLogprobs:
    """One dict per row: its own token (sampled, or the prompt's) with its rank, then the top-k
    with ranks 1..k; a top-k token equal to the row's own token keeps the own entry."""
    entries = []
    for ids, values, rank in zip(
        rows.logprob_token_ids, rows.logprobs, rows.sampled_token_ranks, strict=True
    ):
        entry: dict[int, Logprob] = {}
        for pos, (token_id, value) in enumerate(zip(ids, values, strict=True)):
            if token_id in entry:
                continue  # the row's token also appears among the top-k
            entry[token_id] = Logprob(
                logprob=value,
                rank=rank if pos == 0 else pos,
                decoded_token=str(tokenizer.decode([token_id])),
            )
        entries.append(entry)
    return entries


def prompt_logprobs_entries(
    rows: LogprobsLists | None, tokenizer: PreTrainedTokenizerBase
) -> PromptLogprobs:
    """A prompt's logprobs: None for the first token (nothing precedes it), then one entry per
    row (the core sends rows for prompt tokens 1 .. P-1)."""
    return [None, *(logprob_entries(rows, tokenizer) if rows else [])]


def sampled_logprob_sum(rows: LogprobsLists) -> float:
    """The sum of the rows' own (sampled) token logprobs: a sequence's cumulative logprob step."""
    return sum(values[0] for values in rows.logprobs)


# -- entries → OpenAI bodies (server) ------------------------------------------------------------


def top_logprobs(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The top-k alternatives of one position, by rank (the own token only if it is within k)."""
    ranked = sorted(entry.items(), key=lambda item: item[1].rank or 0)
    return [(tid, lp) for tid, lp in ranked if lp.rank is not None and lp.rank <= k][:k]


def token_text(token_id: int, logprob: Logprob | None, tokenizer: PreTrainedTokenizerBase) -> str:
    """The token's text: the entry's decoded text, else the tokenizer's (no entry for it)."""
    if logprob is not None and logprob.decoded_token is not None:
        return logprob.decoded_token
    return str(tokenizer.decode([token_id]))


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
