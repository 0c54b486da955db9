"""The llguidance backend: the same constraints through llguidance's lazy (Earley) matcher.

llguidance has no compiled form separate from a matcher: "compiling" builds a matcher (which
checks the grammar), the cache keeps that matcher as a template and each request gets a deep
copy. It stops as soon as only EOS can follow (xgrammar waits for the EOS itself), so this
wrapper counts a grammar as terminated only once it consumed a stop token, which keeps the
`Grammar` contract identical across backends.
"""

from __future__ import annotations

import json
from typing import Any, Literal

import llguidance
import llguidance.hf
import llguidance.torch
import torch

from fleetserve.engine.structured_output.backend import (
    CompiledGrammar,
    Grammar,
    GrammarBackend,
    GrammarCompileError,
)
from fleetserve.engine.structured_output.params import StructuredOutputsParams

__all__ = ["LLGuidanceBackend", "LLGuidanceGrammar"]


class LLGuidanceGrammar(Grammar):
    """A request's `llguidance.LLMatcher`."""

    def __init__(self, matcher: llguidance.LLMatcher, stop_token_ids: frozenset[int]) -> None:
        self._matcher = matcher
        self._stop_token_ids = stop_token_ids
        self._accepted: list[int] = []

    def accept_tokens(self, token_ids: list[int]) -> bool:
        # NOTE: validate first: a rejected token puts an llguidance matcher in an error state.
        if self._num_valid(token_ids) != len(token_ids):
            return False
        # NOTE: the matcher never sees a stop token (a stopped llguidance matcher refuses it);
        # it is kept in `_accepted` only, where it can only be last.
        head = [t for t in token_ids if t not in self._stop_token_ids]
        if head and not self._matcher.consume_tokens(head):
            raise RuntimeError(f"llguidance refused tokens it validated: {head}")
        self._accepted.extend(token_ids)
        return True

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        return token_ids[: self._num_valid(token_ids)]

    def _num_valid(self, token_ids: list[int]) -> int:
        """The valid prefix's length; a stop token is valid where the grammar may end, and
        nothing after it is."""
        if self.is_terminated():
            return 0
        cut = next((i for i, t in enumerate(token_ids) if t in self._stop_token_ids), None)
        head = token_ids if cut is None else token_ids[:cut]
        num_valid = self._matcher.validate_tokens(head) if head else 0
        if cut is None or num_valid < cut:
            return num_valid
        if head and not self._matcher.consume_tokens(head):
            raise RuntimeError(f"llguidance refused tokens it validated: {head}")
        may_end = self._matcher.is_accepting()
        if head:
            self._matcher.rollback(len(head))
        return num_valid + 1 if may_end else num_valid

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= len(self._accepted):
            raise ValueError(
                f"num_tokens must be in [0, {len(self._accepted)}] (the tokens accepted), "
                f"got {num_tokens}"
            )
        if not num_tokens:
            return
        num_consumed = num_tokens - (1 if self.is_terminated() else 0)
        if num_consumed:
            self._matcher.rollback(num_consumed)
        del self._accepted[-num_tokens:]

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self.is_terminated():
            bitmask[row].fill_(-1)
        else:
            llguidance.torch.fill_next_token_bitmask(self._matcher, bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._accepted) and self._accepted[-1] in self._stop_token_ids

    @property
    def num_accepted_tokens(self) -> int:
        return len(self._accepted)


class LLGuidanceBackend(GrammarBackend):
    """Builds llguidance matchers for one tokenizer (arguments as `XgrammarBackend`'s)."""

    name = "llguidance"

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._vocab_size = vocab_size
        self._stop_token_ids = frozenset(stop_token_ids)
        self._tokenizer = llguidance.hf.from_tokenizer(
            tokenizer, n_vocab=vocab_size, eos_token=list(stop_token_ids) or None
        )

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        kind, text = _grammar_source(params)
        try:
            grammar = llguidance.grammar_from(kind, text)
        except ValueError as exc:
            raise GrammarCompileError(
                f"structured_outputs.{params.kind} does not compile: {exc}"
            ) from exc
        matcher = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            reason = " ".join(matcher.get_error().split())
            raise GrammarCompileError(
                f"structured_outputs.{params.kind} does not compile: {reason}"
            )
        return matcher

    def new_grammar(self, compiled: CompiledGrammar) -> Grammar:
        return LLGuidanceGrammar(compiled.deep_copy(), self._stop_token_ids)


_Format = Literal["json_schema", "regex", "choice", "grammar"]


def _grammar_source(params: StructuredOutputsParams) -> tuple[_Format, str]:
    if params.json is not None:
        return "json_schema", params.json
    if params.json_object:
        return "json_schema", '{"type": "object"}'
    if params.regex is not None:
        return "regex", params.regex
    if params.choice is not None:
        return "choice", json.dumps(list(params.choice))
    assert params.grammar is not None, "a constraint without a spec"
    return "grammar", params.grammar
