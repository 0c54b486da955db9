"""Chat messages → prompt token ids through the model's chat template.

One normalizer for every entry path (offline `LLM.chat` and the HTTP server), so both give
identical prompt token ids for the same conversation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

_ROLES = ("system", "user", "assistant", "tool", "developer")


def normalize_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, str]]:
    """Validate OpenAI-style messages and flatten text content parts into strings.

    Raises:
        ValueError: empty conversation, unknown role, or non-text content.
    """
    if not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out: list[dict[str, str]] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in _ROLES:
            raise ValueError(f"messages[{i}].role must be one of {_ROLES}, got {role!r}")
        out.append({"role": str(role), "content": _text_of(message.get("content"), i)})
    return out


def _text_of(content: Any, index: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if not isinstance(part, Mapping) or part.get("type") != "text":
                raise ValueError(
                    f"messages[{index}].content parts must be of type 'text' (no multimodal input)"
                )
            parts.append(str(part.get("text", "")))
        return "\n".join(parts)
    raise ValueError(f"messages[{index}].content must be a string or a list of text parts")


def apply_chat_template(
    tokenizer: PreTrainedTokenizerBase,
    messages: Sequence[Mapping[str, Any]],
    *,
    add_generation_prompt: bool = True,
) -> list[int]:
    """Render the conversation with the model's chat template and tokenize it."""
    if not tokenizer.chat_template:
        raise ValueError("the model's tokenizer has no chat template; use completions instead")
    text = tokenizer.apply_chat_template(
        normalize_messages(messages), add_generation_prompt=add_generation_prompt, tokenize=False
    )
    # NOTE: the template already contains any special tokens; adding them again would double BOS.
    ids: list[int] = tokenizer.encode(str(text), add_special_tokens=False)
    return ids
