"""`StructuredOutputManager`: one per engine core; compiles grammars and fills the step bitmask.

- The backend is created on the first structured request (`backend_factory`, in the compile
  pool, so its import and vocabulary build do not stall the step loop either), never before:
  an engine that serves no constrained request never imports xgrammar.
- Compiles run in a pool of `max_workers` threads while the request waits in
  WAITING_FOR_GRAMMAR (the scheduler skips it); a compile never runs on the step loop. The pool's
  queue is bounded by the scheduler's own admission (each queued compile is a live request), and
  requests with the same constraint share one compile in flight.
- Compiled grammars are cached by the constraint (`StructuredOutputsParams.key`), LRU, at most
  `max_cached_grammars`; a hit needs no compile at all (its request is ready at once).
- The bitmask of a step is filled row by row; batches of `PARALLEL_FILL_MIN_ROWS` rows or more
  are filled in chunks on a second pool (bit-identical to the sequential fill).
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch

from fleetserve.engine.structured_output.backend import CompiledGrammar, Grammar, GrammarBackend
from fleetserve.engine.structured_output.params import StructuredOutputsParams
from fleetserve.engine.structured_output.request_grammar import RequestGrammar
from fleetserve.engine.structured_output.speculative import fill_draft_rows
from fleetserve.engine.structured_output.step_bitmask import GrammarBitmask, bitmask_width

__all__ = ["PARALLEL_FILL_CHUNK", "PARALLEL_FILL_MIN_ROWS", "StructuredOutputManager"]

logger = logging.getLogger(__name__)

PARALLEL_FILL_MIN_ROWS = 128
"""Batches with at least this many constrained rows (and no drafts) are filled in parallel."""
PARALLEL_FILL_CHUNK = 16
"""Rows per task of the parallel fill."""


class StructuredOutputManager:
    """Grammar compilation, caching and per-step masks for one engine core.

    Args:
        backend_factory: builds the backend (called once, on the first structured request).
        max_workers: compile threads.
        max_cached_grammars: compiled grammars kept (LRU); 0 disables the cache.
    """

    def __init__(
        self,
        backend_factory: Callable[[], GrammarBackend],
        *,
        max_workers: int = 1,
        max_cached_grammars: int = 128,
    ) -> None:
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        if max_cached_grammars < 0:
            raise ValueError(f"max_cached_grammars must be >= 0, got {max_cached_grammars}")
        self._backend_factory = backend_factory
        self._backend: GrammarBackend | None = None
        self._max_workers = max_workers
        self._compile_pool: ThreadPoolExecutor | None = None
        self._fill_pool: ThreadPoolExecutor | None = None
        self._max_cached = max_cached_grammars
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._in_flight: dict[tuple[str, str], Future[CompiledGrammar]] = {}
        self._lock = threading.Lock()
        """Guards the cache and the in-flight map (compile threads insert when they finish)."""
        self._backend_lock = threading.Lock()
        """Makes the backend once, whichever compile thread comes first."""
        self.num_cache_hits = 0
        self.num_compiles = 0
        self._bitmask: torch.Tensor | None = None

    # -- compile ---------------------------------------------------------------------------------

    @property
    def backend(self) -> GrammarBackend | None:
        """The backend, once the first structured request created it."""
        return self._backend

    def _ensure_backend(self) -> GrammarBackend:
        """The backend, made on first use (from a compile thread)."""
        with self._backend_lock:
            if self._backend is None:
                self._backend = self._backend_factory()
                logger.info("structured output backend %s ready", self._backend.name)
            return self._backend

    def _new_grammar(self, compiled: CompiledGrammar) -> Grammar:
        return self._ensure_backend().new_grammar(compiled)

    def init_request(self, params: StructuredOutputsParams) -> RequestGrammar:
        """Start (or find) the compile of `params`; the result is ready when `is_compiled`."""
        if self._compile_pool is None:
            self._compile_pool = ThreadPoolExecutor(
                self._max_workers, thread_name_prefix="grammar-compile"
            )
        key = params.key
        with self._lock:
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                future: Future[CompiledGrammar] = Future()
                future.set_result(compiled)
                return RequestGrammar(params, future, self._new_grammar)
            in_flight = self._in_flight.get(key)
            if in_flight is None:
                assert self._compile_pool is not None
                self.num_compiles += 1
                in_flight = self._compile_pool.submit(self._compile, params)
                self._in_flight[key] = in_flight
        return RequestGrammar(params, in_flight, self._new_grammar)

    def _compile(self, params: StructuredOutputsParams) -> CompiledGrammar:
        key = params.key
        try:
            compiled = self._ensure_backend().compile(params)
        except BaseException:
            with self._lock:
                self._in_flight.pop(key, None)
            raise
        # NOTE: one critical section, so that a request for the same key finds the grammar in
        # flight or cached, never neither (which would compile it twice).
        with self._lock:
            self._in_flight.pop(key, None)
            if self._max_cached:
                self._cache[key] = compiled
                while len(self._cache) > self._max_cached:
                    self._cache.popitem(last=False)
        return compiled

    @property
    def num_cached_grammars(self) -> int:
        return len(self._cache)

    def wait_for_compile(self, grammars: Sequence[RequestGrammar], timeout_s: float) -> None:
        """Block up to `timeout_s` until one of `grammars` finished compiling (an idle engine
        whose only work is compiling waits here instead of spinning)."""
        pending = [g.future for g in grammars if not g.is_compiled]
        if pending:
            wait(pending, timeout=timeout_s, return_when=FIRST_COMPLETED)

    # -- per step ------------------------------------------------------------------------------

    def grammar_bitmask(
        self,
        grammars: Sequence[tuple[str, Grammar]],
        draft_token_ids: dict[str, list[int]] | None = None,
    ) -> GrammarBitmask | None:
        """The masks of this step's constrained sampling requests, in the given order.

        Args:
            grammars: (request id, its grammar) of each constrained request that samples.
            draft_token_ids: request id → its draft tokens this step (speculative decoding):
                such a request gets 1 + k rows (see `speculative.fill_draft_rows`).

        Returns:
            None when `grammars` is empty.
        """
        if not grammars:
            return None
        backend = self._backend
        assert backend is not None, "a grammar before any backend"
        drafts = draft_token_ids or {}
        num_rows = {req_id: 1 + len(drafts.get(req_id, ())) for req_id, _ in grammars}
        total = sum(num_rows.values())
        bitmask = self._bitmask_buffer(total, backend.vocab_size)
        row_of: dict[str, int] = {}
        row = 0
        for req_id, _ in grammars:
            row_of[req_id] = row
            row += num_rows[req_id]
        if not drafts and total >= PARALLEL_FILL_MIN_ROWS:
            self.fill_parallel([g for _, g in grammars], bitmask)
        else:
            for req_id, grammar in grammars:
                fill_draft_rows(grammar, drafts.get(req_id, []), bitmask, row_of[req_id])
        return GrammarBitmask(
            row_of=row_of, num_rows=num_rows, bitmask=bitmask[:total].numpy().copy()
        )

    def fill_parallel(self, grammars: Sequence[Grammar], bitmask: torch.Tensor) -> None:
        """Row i of `bitmask` ← the mask of `grammars[i]`, in chunks on the fill pool."""
        if self._fill_pool is None:
            self._fill_pool = ThreadPoolExecutor(
                max(1, self._max_workers), thread_name_prefix="grammar-fill"
            )

        def fill(start: int) -> None:
            for row in range(start, min(start + PARALLEL_FILL_CHUNK, len(grammars))):
                grammars[row].fill_bitmask(bitmask, row)

        futures = [
            self._fill_pool.submit(fill, start)
            for start in range(0, len(grammars), PARALLEL_FILL_CHUNK)
        ]
        for future in futures:
            future.result()

    def _bitmask_buffer(self, num_rows: int, vocab_size: int) -> torch.Tensor:
        """A CPU int32 buffer of at least `num_rows` rows, reused across steps."""
        width = bitmask_width(vocab_size)
        if self._bitmask is None or self._bitmask.shape[0] < num_rows:
            capacity = max(num_rows, 2 * (0 if self._bitmask is None else self._bitmask.shape[0]))
            self._bitmask = torch.full((capacity, width), -1, dtype=torch.int32)
        return self._bitmask

    def shutdown(self) -> None:
        """Stop the pools (compiles not started are dropped)."""
        for pool in (self._compile_pool, self._fill_pool):
            if pool is not None:
                pool.shutdown(wait=False, cancel_futures=True)
