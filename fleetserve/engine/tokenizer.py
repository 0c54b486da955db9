"""Tokenizer loading and prompt encoding (one place, shared by the offline API and the server)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(model: str | Path) -> PreTrainedTokenizerBase:
    """Load the HF tokenizer stored in a model folder (fast tokenizer when available)."""
    from transformers import AutoTokenizer

    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model))
    return tokenizer


def eos_token_id_of(tokenizer: PreTrainedTokenizerBase, hf_config: dict[str, Any]) -> int | None:
    """The id that ends generation: generation/model config first, then the tokenizer's."""
    configured = hf_config.get("eos_token_id")
    if isinstance(configured, list):
        configured = configured[0] if configured else None
    if isinstance(configured, int):
        return configured
    eos = tokenizer.eos_token_id
    return int(eos) if eos is not None else None


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Token ids of a completion prompt (special tokens as the tokenizer adds them)."""
    ids: list[int] = tokenizer.encode(prompt)
    return ids
