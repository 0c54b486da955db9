"""Tokenizer loading and prompt encoding (one place, shared by the offline API and the server)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


def load_tokenizer(model: str | Path) -> PreTrainedTokenizerBase:
    """Load the HF tokenizer stored in a model folder (fast tokenizer when available)."""
    from transformers import AutoTokenizer

    tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model))
    return tokenizer


def eos_token_ids(
    model_dir: str | Path,
    hf_config: dict[str, Any],
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> tuple[int, ...]:
    """Every token id that ends generation (the one reader of EOS for the whole engine).

    The first source that names any wins: generation_config.json's `eos_token_id`, then
    config.json's (an int or a list in either), then the tokenizer's `eos_token_id`. Models
    such as Llama 3 list several (end of turn and end of text); each of them stops a request.
    """
    candidates: list[Any] = []
    gen_path = Path(model_dir) / "generation_config.json"
    if gen_path.is_file():
        candidates.append(json.loads(gen_path.read_text()).get("eos_token_id"))
    candidates.append(hf_config.get("eos_token_id"))
    if tokenizer is not None:
        candidates.append(tokenizer.eos_token_id)
    for value in candidates:
        ids = value if isinstance(value, list) else [value]
        found = tuple(dict.fromkeys(int(i) for i in ids if i is not None))
        if found:
            return found
    return ()


def encode_prompt(tokenizer: PreTrainedTokenizerBase, prompt: str) -> list[int]:
    """Token ids of a completion prompt (special tokens as the tokenizer adds them)."""
    ids: list[int] = tokenizer.encode(prompt)
    return ids
