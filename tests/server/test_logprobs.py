"""The OpenAI logprob shapes (`server/logprobs.py`), with a stub tokenizer whose decode is
visible in the results."""

from __future__ import annotations

from fleetserve.engine.request_output import Logprob
from fleetserve.server.logprobs import chat_logprobs, completion_logprobs


class _Tokenizer:
    """Decodes id i to "<i>" (every text length is visible in the offsets)."""

    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{i}>" for i in ids)


TOKENIZER = _Tokenizer()


def _entry(*ranked: tuple[int, float, int]) -> dict[int, Logprob]:
    return {tid: Logprob(value, rank, f"t{tid}") for tid, value, rank in ranked}


def test_completion_shape_offsets_and_the_position_without_an_entry() -> None:
    rows = [(1, None), (5, _entry((5, -3.0, 4), (8, -0.1, 1)))]
    result, offset = completion_logprobs(rows, 1, TOKENIZER, 10)  # type: ignore[arg-type]
    assert result.tokens == ["<1>", "t5"]  # decoded only where no entry names the token
    assert result.token_logprobs == [None, -3.0]
    assert result.text_offset == [10, 13]
    assert result.top_logprobs == [None, {"t8": -0.1}]
    assert offset == 15


def test_chat_shape_with_bytes_and_alternatives() -> None:
    entries = [_entry((5, -3.0, 4), (8, -0.1, 1)), {}]
    result = chat_logprobs([5, 6], entries, 1, TOKENIZER)  # type: ignore[arg-type]
    assert result.content is not None
    first, second = result.content
    assert (first.token, first.logprob, first.bytes) == ("t5", -3.0, list(b"t5"))
    assert [(t.token, t.logprob, t.bytes) for t in first.top_logprobs] == [
        ("t8", -0.1, list(b"t8"))
    ]
    assert (second.token, second.logprob, second.top_logprobs) == ("<6>", float("-inf"), [])
