"""A real xgrammar backend over the tiny byte-level tokenizer (every character is one token)."""

from __future__ import annotations

from pathlib import Path

from fleetserve.engine.structured_output.manager import StructuredOutputManager
from fleetserve.engine.structured_output.xgrammar_backend import XgrammarBackend
from tests.engine.tiny_models import save_tiny_tokenizer

VOCAB_SIZE = 300
"""Not a multiple of 32: the last bitmask word is partly padding."""
EOS = 2


def tiny_backend(tmp_path: Path) -> tuple[XgrammarBackend, object]:
    from transformers import AutoTokenizer

    save_tiny_tokenizer(tmp_path, VOCAB_SIZE)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    return XgrammarBackend(tokenizer, VOCAB_SIZE, [EOS]), tokenizer


def tiny_manager(tmp_path: Path, **kwargs: int) -> tuple[StructuredOutputManager, object]:
    backend, tokenizer = tiny_backend(tmp_path)
    return StructuredOutputManager(lambda: backend, **kwargs), tokenizer


def ids(tokenizer: object, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
