"""What a request asks its output to follow: `StructuredOutputsParams` (torch-free).

The API server builds it from the OpenAI body and validates it here, so a malformed constraint
is a 400 before anything reaches the engine core; the core compiles it (`manager.py`). Exactly
one constraint per request: a JSON schema, any JSON object, a regular expression, a choice
among strings, or a grammar (EBNF, in the GBNF dialect xgrammar and llama.cpp read).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

__all__ = ["MAX_SPEC_CHARS", "StructuredOutputsParams"]

MAX_SPEC_CHARS = 1_000_000
"""Longest schema, regex or grammar text a request may carry (bounds what the core compiles)."""

_KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """One output constraint (vLLM's `StructuredOutputsParams` names).

    Attributes:
        json: a JSON schema, as JSON text (a dict given to `create` is serialised compactly;
            key order is kept: it is the order the properties are generated in).
        json_object: any JSON object (OpenAI's `response_format: {"type": "json_object"}`).
        regex: the whole output matches this regular expression.
        choice: the output is exactly one of these strings.
        grammar: the output is a sentence of this EBNF grammar (its start rule is `root`).
    """

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None

    def __post_init__(self) -> None:
        self._validate()

    @classmethod
    def create(
        cls,
        *,
        json: str | dict[str, Any] | bool | None = None,
        json_object: bool = False,
        regex: str | None = None,
        choice: list[str] | tuple[str, ...] | None = None,
        grammar: str | None = None,
    ) -> StructuredOutputsParams:
        """Build from the looser shapes requests carry (a schema as a dict, a choice list).

        Raises:
            ValueError: none or more than one constraint, or one that is malformed; the message
                names the field (`structured_outputs.json`, ...) and what is allowed.
        """
        if json is not None and not isinstance(json, str):
            json = _dump_schema(json)
        if choice is not None and not isinstance(choice, list | tuple):
            raise ValueError(
                f"structured_outputs.choice must be a list of strings, got {type(choice).__name__}"
            )
        return cls(
            json=json,
            json_object=json_object,
            regex=regex,
            choice=tuple(choice) if choice is not None else None,
            grammar=grammar,
        )

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> StructuredOutputsParams:
        """From `to_dict()`'s form (e.g. a msgpack payload); unknown keys raise ValueError."""
        unknown = set(values) - set(_KINDS)
        if unknown:
            raise ValueError(
                f"unknown structured_outputs field(s) {sorted(unknown)}; allowed: {list(_KINDS)}"
            )
        return cls.create(**values)

    def to_dict(self) -> dict[str, Any]:
        return {
            "json": self.json,
            "json_object": self.json_object,
            "regex": self.regex,
            "choice": list(self.choice) if self.choice is not None else None,
            "grammar": self.grammar,
        }

    @property
    def kind(self) -> str:
        """Which constraint: 'json', 'json_object', 'regex', 'choice' or 'grammar'."""
        return next(name for name in _KINDS if getattr(self, name) not in (None, False))

    @property
    def key(self) -> tuple[str, str]:
        """(kind, spec text): equal keys compile to the same grammar (the cache's key)."""
        kind = self.kind
        if kind == "json_object":
            return kind, ""
        if kind == "choice":
            assert self.choice is not None
            return kind, _json.dumps(list(self.choice))
        return kind, str(getattr(self, kind))

    def _validate(self) -> None:
        given = [name for name in _KINDS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise ValueError(
                "structured_outputs must set exactly one of "
                f"{', '.join(_KINDS)}; got {given or 'none'}"
            )
        for name in ("json", "regex", "grammar"):
            text = getattr(self, name)
            if text is None:
                continue
            if not isinstance(text, str) or not text.strip():
                raise ValueError(f"structured_outputs.{name} must be a non-empty string")
            if len(text) > MAX_SPEC_CHARS:
                raise ValueError(
                    f"structured_outputs.{name} is {len(text)} characters; at most "
                    f"{MAX_SPEC_CHARS} are allowed"
                )
        if self.json is not None:
            _check_schema(self.json)
        if self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as exc:
                raise ValueError(f"structured_outputs.regex is not a valid regex: {exc}") from exc
        if self.choice is not None and (
            not self.choice or not all(isinstance(c, str) and c for c in self.choice)
        ):
            raise ValueError(
                "structured_outputs.choice must be a non-empty list of non-empty strings"
            )


_json = json  # NOTE: the `json` field shadows the module inside the class body.


def _dump_schema(schema: Any) -> str:
    if not isinstance(schema, dict | bool):
        raise ValueError(
            f"structured_outputs.json must be a JSON schema (an object), got {type(schema).__name__}"
        )
    return _json.dumps(schema, separators=(",", ":"))


def _check_schema(text: str) -> None:
    """The schema parses and is valid against its JSON Schema meta-schema (Draft 2020-12 unless
    it names its own `$schema`), so a typo like `"type": "strin"` is a 400 that names it."""
    try:
        schema = _json.loads(text)
    except ValueError as exc:
        raise ValueError(f"structured_outputs.json is not valid JSON: {exc}") from exc
    if not isinstance(schema, dict | bool):
        raise ValueError(
            f"structured_outputs.json must be a JSON schema (an object), got {type(schema).__name__}"
        )
    import jsonschema  # NOTE: lazily: most requests carry no schema.

    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        where = "/".join(str(part) for part in exc.absolute_path) or "(root)"
        raise ValueError(
            f"structured_outputs.json is not a valid JSON schema at {where}: {exc.message}"
        ) from exc
