"""Tokenizer loading and prompt encoding (one place, shared by the offline API and the server)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
    "sentencepiece.bpe.model",
)
"""A model folder holds its tokenizer in one of these (fast JSON, SentencePiece, BPE/WordPiece
vocabularies); `tokenizer_config.json` alone is not a tokenizer."""

NO_TOKENIZER_HINT = (
    "add the model's tokenizer files, or start the engine with skip_tokenizer_init=True "
    "(--skip-tokenizer-init) to serve token-id prompts and outputs only"
)


def load_tokenizer(model: str | Path) -> PreTrainedTokenizerBase:
    """Load the HF tokenizer stored in a model folder (fast tokenizer when available).

    Raises:
        ValueError: the folder holds no tokenizer (the message names the files looked for),
            or transformers could not load it (its error, with the folder).
    """
    folder = Path(model)
    if folder.is_dir() and not any((folder / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(
            f"model folder {str(folder)!r} has no tokenizer: none of {list(TOKENIZER_FILES)} "
            f"is there; {NO_TOKENIZER_HINT}"
        )
    from transformers import AutoTokenizer

    try:
        tokenizer: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(str(model))
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(
            f"cannot load the tokenizer of {str(model)!r} ({type(exc).__name__}: {exc}); "
            f"{NO_TOKENIZER_HINT}"
        ) from exc
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
