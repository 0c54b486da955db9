"""Incremental detokenization of one request's output, with stop strings (seed part 2 §2.3).

Lifecycle: the front end creates one `IncrementalDetokenizer` per request (primed with the tail of the
prompt, so the first output token decodes with its left context), feeds it the new token ids of
every engine step through `update()` (which also reports a matched stop string) and streams
`get_next_output_text()`; a single cursor guarantees that the deltas concatenate to the final text.

Token → text goes through a `TokenDecoder`: `tokenizers`' `DecodeStream` when the tokenizer is a
fast one, else a Python port of the same algorithm (decode a short window of recent tokens, emit the
suffix beyond the text already emitted, wait while the text ends in U+FFFD, i.e. a UTF-8 character
split across tokens). Both cost O(new tokens) per step and produce identical text. A tokenizer error
rebuilds the decoder state and never ends the request.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

from tokenizers import decoders

from fleetserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

_REPLACEMENT_CHAR = "\ufffd"
_NUM_CONTEXT_TOKENS = 5
"""Tokens of left context a decoder is primed with (prompt tail, or recent tokens on recovery)."""


class _InvalidPrefixError(Exception):
    """The window's text no longer starts with the text already emitted (non-monotonic UTF-8)."""


class TokenDecoder(ABC):
    """Turns token ids into text one at a time; `decode_next` never raises for a bad token."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._context: list[int] = []

    def prime(self, token_ids: list[int]) -> None:
        """Feed left context (e.g. the prompt tail) whose text is not part of the output."""
        for token_id in token_ids:
            self.decode_next(token_id)

    def decode_next(self, token_id: int) -> str:
        """Add one token; return the text it completes ('' while a character is still split)."""
        try:
            text = self._step(token_id)
        except Exception as exc:
            # NOTE: tokenizer errors (tokenizers' "Invalid prefix" on non-monotonic UTF-8, odd
            # ids) must not end the request: restart from recent context and retry once.
            logger.warning("detokenizer error on token %r (%s); rebuilding", token_id, exc)
            text = self._recover(token_id)
        self._context = [*self._context[-(_NUM_CONTEXT_TOKENS - 1) :], token_id]
        return text or ""

    def _recover(self, token_id: int) -> str | None:
        self._reset()
        try:
            for context_id in self._context:
                self._step(context_id)
        except Exception:
            logger.warning("detokenizer context replay failed; continuing without context")
            self._reset()
        try:
            return self._step(token_id)
        except Exception:
            logger.exception("detokenizer cannot decode token %r; its text is dropped", token_id)
            self._reset()
            return None

    @abstractmethod
    def _step(self, token_id: int) -> str | None:
        """Advance by one token; may raise on a tokenizer error."""

    @abstractmethod
    def _reset(self) -> None:
        """Forget all decoding state (no left context)."""


class FastTokenDecoder(TokenDecoder):
    """`tokenizers.decoders.DecodeStream` over the fast tokenizer's Rust backend."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> None:
        super().__init__(tokenizer, skip_special_tokens)
        self._backend: Any = tokenizer.backend_tokenizer
        self._stream: Any = None
        self._reset()

    def _reset(self) -> None:
        self._stream = decoders.DecodeStream(skip_special_tokens=self.skip_special_tokens)

    def _step(self, token_id: int) -> str | None:
        text: str | None = self._stream.step(self._backend, token_id)
        return text


class SlowTokenDecoder(TokenDecoder):
    """The same algorithm as `DecodeStream`, in Python over `tokenizer.decode` (any tokenizer).

    `_ids` holds the tokens of the last emitted chunk (whose text is `_prefix`) followed by the
    tokens not yet emitted; each step decodes only this short window.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool) -> None:
        super().__init__(tokenizer, skip_special_tokens)
        self._ids: list[int] = []
        self._prefix = ""
        self._prefix_index = 0

    def _reset(self) -> None:
        self._ids = []
        self._prefix = ""
        self._prefix_index = 0

    def _decode(self, token_ids: list[int]) -> str:
        text = self.tokenizer.decode(
            token_ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )
        assert isinstance(text, str), f"decode of a flat id list returned {type(text)}"
        return text

    def _step(self, token_id: int) -> str | None:
        self._ids.append(token_id)
        text = self._decode(self._ids)
        # NOTE: byte lengths, as DecodeStream compares them, so both paths agree exactly.
        if len(text.encode()) <= len(self._prefix.encode()) or text.endswith(_REPLACEMENT_CHAR):
            return None
        if not text.startswith(self._prefix):
            raise _InvalidPrefixError(f"{text!r} does not extend {self._prefix!r}")
        new_text = text[len(self._prefix) :]
        self._ids = self._ids[self._prefix_index :]
        self._prefix = self._decode(self._ids)
        self._prefix_index = len(self._ids)
        return new_text


def make_token_decoder(
    tokenizer: PreTrainedTokenizerBase, prompt_token_ids: list[int], skip_special_tokens: bool
) -> TokenDecoder:
    """The fast decoder when the tokenizer has a Rust backend, else the slow one; primed."""
    is_fast = getattr(tokenizer, "is_fast", False) and hasattr(tokenizer, "backend_tokenizer")
    decoder: TokenDecoder
    if is_fast and hasattr(decoders, "DecodeStream"):
        decoder = FastTokenDecoder(tokenizer, skip_special_tokens)
    else:
        decoder = SlowTokenDecoder(tokenizer, skip_special_tokens)
    decoder.prime(prompt_token_ids[-_NUM_CONTEXT_TOKENS:])
    return decoder


def check_stop_strings(
    output_text: str, new_char_count: int, stop: list[str], include_in_output: bool
) -> tuple[str, int] | None:
    """Find a stop string that overlaps the last `new_char_count` characters.

    The search starts `len(stop_str) - 1` characters before the new text, so a stop string split
    across tokens is caught while one lying wholly in older text is not found again.

    Returns:
        (stop string, length to truncate the text to) for the match that ends first (on a tie the
        longer one), or None. The text keeps the stop string only when `include_in_output`.
    """
    if not new_char_count or not stop:
        return None
    best: tuple[int, int, str] | None = None  # (end, -length, stop string)
    for stop_str in stop:
        search_from = max(0, len(output_text) + 1 - new_char_count - len(stop_str))
        start = output_text.find(stop_str, search_from)
        if start == -1:
            continue
        candidate = (start + len(stop_str), -len(stop_str), stop_str)
        if best is None or candidate < best:
            best = candidate
    if best is None:
        return None
    end, negative_length, stop_str = best
    return stop_str, end if include_in_output else end + negative_length


class IncrementalDetokenizer:
    """One request's output text, built token by token, cut at the first stop string."""

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        skip_special_tokens: bool = True,
    ) -> None:
        self._decoder = make_token_decoder(tokenizer, prompt_token_ids, skip_special_tokens)
        self._token_ids: list[int] = []
        self._output_text = ""
        self._stop = list(params.stop)
        self._min_tokens = params.min_tokens
        self._include_stop_str_in_output = params.include_stop_str_in_output
        self._stop_buffer_length = params.stop_buffer_length
        self._last_output_text_offset = 0
        """The streaming cursor: text before it has been returned as deltas."""

    @property
    def output_text(self) -> str:
        return self._output_text

    @property
    def token_ids(self) -> list[int]:
        """Output token ids seen so far (including a stop token whose text is left out)."""
        return self._token_ids

    def update(self, new_token_ids: list[int], stop_terminated: bool) -> str | None:
        """Decode this step's tokens and check the stop strings.

        Args:
            new_token_ids: tokens generated since the last call.
            stop_terminated: the request ended on its last token (EOS or a stop token id); that
                token's text is left out unless `include_stop_str_in_output`.

        Returns:
            The stop string that matched (the text is then cut there), or None.
        """
        decode_ids = new_token_ids
        if stop_terminated and new_token_ids and not self._include_stop_str_in_output:
            decode_ids = new_token_ids[:-1]
        text = self._output_text
        stop_check_offset = len(text)
        pieces: list[str] = []
        num_chars = len(text)
        for token_id in decode_ids:
            self._token_ids.append(token_id)
            piece = self._decoder.decode_next(token_id)
            pieces.append(piece)
            num_chars += len(piece)
            # NOTE: text generated before min_tokens is never searched for a stop string.
            if len(self._token_ids) <= self._min_tokens:
                stop_check_offset = num_chars
        self._token_ids.extend(new_token_ids[len(decode_ids) :])
        self._output_text = text + "".join(pieces)
        if not self._stop or len(self._token_ids) <= self._min_tokens:
            return None
        match = check_stop_strings(
            self._output_text,
            len(self._output_text) - stop_check_offset,
            self._stop,
            self._include_stop_str_in_output,
        )
        if match is None:
            return None
        stop_str, truncate_to = match
        self._output_text = self._output_text[:truncate_to]
        return stop_str

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to report now.

        While unfinished, the last `stop_buffer_length` characters are held back: they could
        still turn out to be the start of a stop string and be cut. Finishing flushes them.

        Args:
            finished: the request has ended (no more `update` calls).
            delta: return only the text since the previous delta call (else the full text).
        """
        buffer_length = 0 if finished else self._stop_buffer_length
        length = max(0, len(self._output_text) - buffer_length)
        if not delta:
            return self._output_text[:length]
        start = self._last_output_text_offset
        if start >= length:
            return ""
        self._last_output_text_offset = length
        return self._output_text[start:length]
