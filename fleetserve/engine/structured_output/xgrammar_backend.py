"""The xgrammar backend: JSON schema, JSON object, regex, choice and EBNF grammars.

xgrammar's own compile cache is off: the manager's cache (bounded, keyed by the constraint) is
the one cache, so its size and its hits are ours to state. Compilation releases the GIL, so a
grammar compiling in the manager's pool does not stall the step loop.
"""

from __future__ import annotations

import json
from typing import Any

import torch
import xgrammar as xgr

from fleetserve.engine.structured_output.backend import (
    CompiledGrammar,
    Grammar,
    GrammarBackend,
    GrammarCompileError,
)
from fleetserve.engine.structured_output.params import StructuredOutputsParams

__all__ = ["XgrammarBackend", "XgrammarGrammar"]


class XgrammarGrammar(Grammar):
    """A request's `xgrammar.GrammarMatcher`, with the count of tokens it accepted."""

    def __init__(self, matcher: xgr.GrammarMatcher) -> None:
        self._matcher = matcher
        self._num_accepted = 0

    def accept_tokens(self, token_ids: list[int]) -> bool:
        for i, token_id in enumerate(token_ids):
            if not self._matcher.accept_token(token_id):
                if i:
                    self._matcher.rollback(i)
                return False
        self._num_accepted += len(token_ids)
        return True

    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        num_valid = 0
        for token_id in token_ids:
            if not self._matcher.accept_token(token_id):
                break
            num_valid += 1
        if num_valid:
            self._matcher.rollback(num_valid)
        return token_ids[:num_valid]

    def rollback(self, num_tokens: int) -> None:
        if not 0 <= num_tokens <= self._num_accepted:
            raise ValueError(
                f"num_tokens must be in [0, {self._num_accepted}] (the tokens accepted), "
                f"got {num_tokens}"
            )
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self._num_accepted -= num_tokens

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        if self._matcher.is_terminated():
            bitmask[row].fill_(-1)
        else:
            self._matcher.fill_next_token_bitmask(bitmask, row)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    @property
    def num_accepted_tokens(self) -> int:
        return self._num_accepted


class XgrammarBackend(GrammarBackend):
    """Compiles with `xgrammar.GrammarCompiler` for one tokenizer.

    Args:
        tokenizer: the engine's Hugging Face tokenizer.
        vocab_size: the logits' width (the model's vocabulary, padding included).
        stop_token_ids: tokens that end a completed grammar (the engine's EOS ids).
        max_threads: threads one compilation may use.
    """

    name = "xgrammar"

    def __init__(
        self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], max_threads: int = 1
    ) -> None:
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        self._vocab_size = vocab_size
        self._compiler = xgr.GrammarCompiler(info, max_threads=max_threads, cache_enabled=False)

    @property
    def vocab_size(self) -> int:
        return self._vocab_size

    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        try:
            if params.json is not None:
                return self._compiler.compile_json_schema(params.json)
            if params.json_object:
                return self._compiler.compile_builtin_json_grammar()
            if params.regex is not None:
                return self._compiler.compile_regex(params.regex)
            if params.choice is not None:
                return self._compiler.compile_grammar(choice_grammar(params.choice))
            assert params.grammar is not None, "a constraint without a spec"
            return self._compiler.compile_grammar(params.grammar)
        except (RuntimeError, ValueError, TypeError) as exc:
            # NOTE: xgrammar raises RuntimeError with its C++ location first; the last line
            # is the reason.
            lines = [line.strip() for line in str(exc).strip().splitlines() if line.strip()]
            reason = lines[-1] if lines else type(exc).__name__
            if "] " in reason and reason.startswith("["):
                reason = reason.split(": ", 1)[-1]
            raise GrammarCompileError(
                f"structured_outputs.{params.kind} does not compile: {reason}"
            ) from exc

    def new_grammar(self, compiled: CompiledGrammar) -> Grammar:
        return XgrammarGrammar(xgr.GrammarMatcher(compiled))


def choice_grammar(choices: tuple[str, ...]) -> str:
    """An EBNF grammar whose sentences are exactly `choices` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(choice) for choice in choices)
