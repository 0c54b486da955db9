"""The engine's `StructuredOutputManager`, with its backend made from the engine config."""

from __future__ import annotations

import os

from fleetserve.engine.config import EngineConfig
from fleetserve.engine.structured_output.backend import GrammarBackend
from fleetserve.engine.structured_output.manager import StructuredOutputManager

__all__ = ["BACKENDS", "create_manager"]

BACKENDS = ("xgrammar", "llguidance")
"""Grammar backends this engine has."""


def create_manager(config: EngineConfig, backend: str = "xgrammar") -> StructuredOutputManager:
    """A manager whose backend (tokenizer + vocabulary) is built on the first structured request.

    Raises:
        ValueError: an unknown `backend`; the message lists `BACKENDS`.
    """
    if backend not in BACKENDS:
        raise ValueError(f"structured output backend must be one of {BACKENDS}, got {backend!r}")

    def make_backend() -> GrammarBackend:
        from fleetserve.engine.tokenizer import eos_token_ids, load_tokenizer

        tokenizer = load_tokenizer(config.model.model)
        stop_ids = list(eos_token_ids(config.model.model, config.model.hf_config, tokenizer))
        if backend == "llguidance":
            from fleetserve.engine.structured_output.llguidance_backend import LLGuidanceBackend

            return LLGuidanceBackend(tokenizer, config.model.vocab_size, stop_ids)
        from fleetserve.engine.structured_output.xgrammar_backend import XgrammarBackend

        return XgrammarBackend(tokenizer, config.model.vocab_size, stop_ids)

    # NOTE: the seed's cpu_count / 2 compile threads (at least one).
    return StructuredOutputManager(make_backend, max_workers=max(1, (os.cpu_count() or 2) // 2))
