"""Front-end logprob shaping: the core's rows → the `Logprob` entries `RequestOutput`s carry.

The engine core sends `LogprobsLists` (per row: the row's own token first — the sampled one, or
the prompt's next token — then the top-k, with the own token's rank). `OutputProcessor` turns
each row into one `{token id: Logprob}` entry here (`logprob_entries`); the server turns entries
into the OpenAI shapes (`fleetserve.server.logprobs`). A token's text comes from the entry
(`decoded_token`, decoded once by the output processor) and is decoded only when a position has
no entry (the first prompt token, which nothing precedes).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from fleetserve.engine.core.outputs import LogprobsLists
from fleetserve.engine.request_output import Logprob, PromptLogprobs, SampleLogprobs

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "logprob_entries",
    "prompt_logprobs_entries",
    "sampled_logprob_sum",
    "token_text",
    "top_logprobs",
]

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
