"""One request's structured-output state: its constraint, its compile, then its grammar."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future

from fleetserve.engine.structured_output.backend import (
    CompiledGrammar,
    Grammar,
    GrammarCompileError,
)
from fleetserve.engine.structured_output.params import StructuredOutputsParams

__all__ = ["RequestGrammar"]


class RequestGrammar:
    """A request's grammar, compiled asynchronously.

    Lifecycle: created with the compile's future (`manager.init_request`); once the future is
    done, `resolve()` makes the request's own `Grammar` (or records the compile's error); from
    then on `grammar` is set or `error` is.
    """

    def __init__(
        self,
        params: StructuredOutputsParams,
        future: Future[CompiledGrammar],
        new_grammar: Callable[[CompiledGrammar], Grammar],
    ) -> None:
        self.params = params
        self._future = future
        self._new_grammar = new_grammar
        self.grammar: Grammar | None = None
        self.error: str | None = None
        self.is_invalid = False
        """The error is the constraint's fault (it does not compile), not the engine's."""

    @property
    def is_compiled(self) -> bool:
        """The compile finished (successfully or not): `resolve()` will not block."""
        return self._future.done()

    @property
    def future(self) -> Future[CompiledGrammar]:
        return self._future

    def resolve(self) -> bool:
        """Adopt the finished compile; True when the request has its grammar now.

        Must only be called once `is_compiled`.
        """
        assert self._future.done(), "resolve() before the compile finished"
        if self.grammar is not None or self.error is not None:
            return self.grammar is not None
        exc = self._future.exception()
        if exc is not None:
            self.error = str(exc) or type(exc).__name__
            self.is_invalid = isinstance(exc, GrammarCompileError)
            return False
        self.grammar = self._new_grammar(self._future.result())
        return True
