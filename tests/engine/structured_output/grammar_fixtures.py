"""Real grammar backends over the tiny byte-level tokenizer (every character is one token)."""

from __future__ import annotations

from pathlib import Path

from fleetserve.engine.structured_output.backend import GrammarBackend
from fleetserve.engine.structured_output.llguidance_backend import LLGuidanceBackend
from fleetserve.engine.structured_output.manager import StructuredOutputManager
from fleetserve.engine.structured_output.xgrammar_backend import XgrammarBackend
from tests.engine.tiny_models import save_tiny_tokenizer

VOCAB_SIZE = 300
"""Not a multiple of 32: the last bitmask word is partly padding."""
EOS = 2
BACKENDS = {"xgrammar": XgrammarBackend, "llguidance": LLGuidanceBackend}


def tiny_backend(tmp_path: Path, name: str = "xgrammar") -> tuple[GrammarBackend, object]:
    from transformers import AutoTokenizer

    save_tiny_tokenizer(tmp_path, VOCAB_SIZE)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    return BACKENDS[name](tokenizer, VOCAB_SIZE, [EOS]), tokenizer


def tiny_manager(
    tmp_path: Path, backend: str = "xgrammar", **kwargs: int
) -> tuple[StructuredOutputManager, object]:
    made, tokenizer = tiny_backend(tmp_path, backend)
    return StructuredOutputManager(lambda: made, **kwargs), tokenizer


def ids(tokenizer: object, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
