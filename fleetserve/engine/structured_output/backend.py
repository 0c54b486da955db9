"""The one interface every grammar backend implements (seed notes part 2 §2.2).

A `GrammarBackend` compiles a `StructuredOutputsParams` into a `CompiledGrammar` (immutable,
shared by every request with the same constraint, so the manager caches it) and makes one
`Grammar` (a matcher with its own state) per request from it. A `Grammar` is only ever used
from the engine core's step loop (never concurrently); compiling runs in the manager's pool.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

from fleetserve.engine.structured_output.params import StructuredOutputsParams

__all__ = ["CompiledGrammar", "Grammar", "GrammarBackend", "GrammarCompileError"]

CompiledGrammar = Any
"""A backend's compiled form of one constraint (opaque to the manager)."""


class GrammarCompileError(ValueError):
    """The constraint does not compile (an unsupported schema feature, a bad grammar, ...)."""


class Grammar(ABC):
    """One request's grammar state: which tokens may come next, advanced token by token.

    Contract: `accept_tokens` is all or nothing; `validate_tokens` and `fill_bitmask` never
    change the state; `rollback(n)` undoes the last n accepted tokens.
    """

    @abstractmethod
    def accept_tokens(self, token_ids: list[int]) -> bool:
        """Advance by every token, or (if one is not allowed) by none and return False."""

    @abstractmethod
    def validate_tokens(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of `token_ids` the grammar allows from its current state."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens.

        Raises:
            ValueError: `num_tokens` is negative or more than were accepted.
        """

    @abstractmethod
    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed next tokens into `bitmask[row]` (int32 words, bit set = allowed).

        A terminated grammar (it accepted its stop token) writes all ones: what follows is
        not the grammar's business (the request ends on that stop token unless it ignores EOS).
        """

    @abstractmethod
    def is_terminated(self) -> bool:
        """Whether the grammar accepted a stop token (nothing more is constrained)."""

    @property
    @abstractmethod
    def num_accepted_tokens(self) -> int:
        """Tokens accepted so far, net of rollbacks."""


class GrammarBackend(ABC):
    """Compiles constraints for one tokenizer and vocabulary.

    Args (of implementations): the tokenizer, the logits' width (`vocab_size`, which may exceed
    the tokenizer's) and the stop token ids that end a completed grammar.
    """

    name: str

    @abstractmethod
    def compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        """Compile one constraint (called from a worker thread; may take seconds).

        Raises:
            GrammarCompileError: the constraint does not compile; the message says why.
        """

    @abstractmethod
    def new_grammar(self, compiled: CompiledGrammar) -> Grammar:
        """A fresh matcher over `compiled` (cheap; one per request)."""

    @property
    @abstractmethod
    def vocab_size(self) -> int:
        """Tokens the bitmask covers (one bit each)."""
